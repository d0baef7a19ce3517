"""Evaluation: offline multiple choice (tasks, scoring harness, synthetic tasks, statistics)
and counterfactual attribution quality (retrains on subsets, LDS, removal curves)."""
