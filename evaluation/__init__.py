"""Evaluation: the benchmark, replay, checkpoint selection, the leakage guard, the fleet eval and the
learner's periodic eval. It plays and scores conversations with rollout/ (the loop and the scoring the
roles run) and imports no role (tests/unit/test_layout.py)."""
