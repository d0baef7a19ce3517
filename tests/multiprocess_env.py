"""The environment of a test's multi-process (jax.distributed) runs."""

import os

# tests/conftest.py sets these under `make test`, so single-process subprocesses share the
# run's persistent compilation cache.
JIT_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def multiprocess_env(**extra) -> dict:
  """os.environ (+ `extra`) without the persistent compilation cache: a process that finds
  its programs cached reaches the first collective long before one that compiles, and a
  loaded box can put that past Gloo's 30 s rendezvous."""
  env = {k: v for k, v in os.environ.items() if k not in JIT_CACHE_VARS}
  env.update(extra)
  return env
