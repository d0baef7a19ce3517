"""Control of a trained model: steering gains from every accepted form and the steering-set
file (steering.py, the one place gains are built and checked), suppression (prototype sets
for a behaviour, their removal, its evaluation), sparse linear controllers over prototype or
SAE codes, the TopK SAE."""
