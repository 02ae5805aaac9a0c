"""The conversation and its score, shared by whoever plays or judges one: the conversation loop
(`conversation.py`) with its token bookkeeping (`chat.py`) and the scoring of one trajectory
(`score.py`). The user side and the judge they ask are the services' clients (services.sim.client,
services.judge.client). Imported by actors/, scorer/ and evaluation/; imports no role
(tests/unit/test_layout.py)."""
