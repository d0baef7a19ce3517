"""The attribution cache: built once per trained model (two passes over the training
split: curvature, then per-token records), stored with tensorstore, sharded across hosts,
indexed per prototype; opened for queries (PRISM.md §5)."""
