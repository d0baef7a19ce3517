"""prism_jax.analysis."""
