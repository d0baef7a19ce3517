"""prism_jax: PRISM prototype language models in JAX/Flax.

  run = prism_jax.load("runs/demo")      # prism_jax/runs.py: generate, decompose, ...
"""

__version__ = "0.1.0"
__all__ = ["__version__", "load"]


def __getattr__(name):
  # `import prism_jax` stays light (no jax import) until a run is loaded
  if name == "load":
    from prism_jax.runs import load  # pylint: disable=g-import-not-at-top  (deferred: jax and the library, until a run is loaded)
    return load
  raise AttributeError(f"module 'prism_jax' has no attribute {name!r}")
