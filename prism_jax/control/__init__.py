"""Control: sparse linear controllers over prototype or SAE codes, and the TopK SAE baseline."""
