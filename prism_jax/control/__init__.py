"""Control of a trained model: suppression (prototype sets for a behaviour, their removal,
its evaluation), sparse linear controllers over prototype or SAE codes, the TopK SAE."""
