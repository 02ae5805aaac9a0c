"""Environments: what a multi-turn task must name for parley to train on it (base.py), how one is
found by name through the `parley.environments` entry points (registry.py), and the two bundled
ones (collabllm.py, hidden_goal/). Neutral: the roles read an environment, it imports no role."""
