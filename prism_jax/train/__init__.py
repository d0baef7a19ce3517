"""prism_jax.train."""
