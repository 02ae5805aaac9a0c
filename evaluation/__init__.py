"""Evaluation: the benchmark, replay, checkpoint selection, the leakage guard, the fleet eval and the
learner's periodic eval. It imports role modules only where they are what is evaluated (the
conversation loop, the scoring of a trajectory); tests/unit/test_layout.py lists them."""
