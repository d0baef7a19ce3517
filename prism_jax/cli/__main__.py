"""`python -m prism_jax.cli <command> ...`: the `prism` console script without installing."""

from prism_jax.cli import main

main.main()
