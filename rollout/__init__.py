"""The conversation and its score, shared by whoever plays or judges one: the conversation loop
(`conversation.py`) with its token bookkeeping (`chat.py`), the user side it asks (`sim.py`), the
scoring of one trajectory (`score.py`) and the judge it asks (`judge.py`). Imported by actors/,
scorer/ and evaluation/; imports no role (tests/unit/test_layout.py)."""
