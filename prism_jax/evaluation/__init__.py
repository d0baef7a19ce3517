"""Offline multiple-choice evaluation: task builders, the scoring harness, synthetic tasks, statistics."""
