"""Evaluation: offline multiple choice (tasks, scoring harness, synthetic tasks, statistics)
and the lm-evaluation-harness adapter. Attribution quality (retrains, LDS, the methods
registry) is prism_jax.attribution.quality."""
