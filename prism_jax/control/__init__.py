"""prism_jax.control."""
