"""prism_jax: PRISM prototype language models in JAX/Flax."""

__version__ = "0.1.0"
