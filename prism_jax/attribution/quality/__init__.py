"""Attribution quality: every method behind one registry (methods.py), retrains on subsets of
the training rows (retrain.py) and the linear datamodeling score with its removal sets
(lds.py)."""
