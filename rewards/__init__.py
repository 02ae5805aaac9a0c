"""Reward definitions shared by the scorer (which computes them), the learner (which diagnoses
them per step) and the evaluation (which replays them): metrics, weights and totals, diagnostics."""
