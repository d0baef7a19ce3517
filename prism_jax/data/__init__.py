"""prism_jax.data."""
