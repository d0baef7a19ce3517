"""The environment of a test's multi-process (jax.distributed) runs."""

import os

# tests/conftest.py sets these under `make test`, so single-process subprocesses share the
# run's persistent compilation cache.
JIT_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def multiprocess_env(cache_dir=None, **extra) -> dict:
  """os.environ (+ `extra`) without the run's persistent compilation cache: a process that
  finds its programs cached reaches the first collective long before one that compiles,
  and a loaded box can put that past Gloo's 30 s rendezvous. `cache_dir`: a cache of the
  test's own, which all its processes start from in the same state."""
  env = {k: v for k, v in os.environ.items() if k not in JIT_CACHE_VARS}
  if cache_dir is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.update(extra)
  return env
