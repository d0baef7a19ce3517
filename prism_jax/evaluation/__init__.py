"""Counterfactual evaluation of attribution: retrains on subsets, LDS, removal curves."""
