"""prism_jax.attribution."""
