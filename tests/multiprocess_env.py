"""The environment of a test's multi-process (jax.distributed) runs."""

import os


def jit_cache_env(cache_dir) -> dict:
  """The environment of a persistent compilation cache in `cache_dir` that keeps every
  program (tests/conftest.py sets it under `make test`, so single-process subprocesses
  share the run's cache)."""
  return {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


JIT_CACHE_VARS = tuple(jit_cache_env(""))


def multiprocess_env(cache_dir=None, **extra) -> dict:
  """os.environ (+ `extra`) without the run's persistent compilation cache: a process that
  finds its programs cached reaches the first collective long before one that compiles,
  and a loaded box can put that past Gloo's 30 s rendezvous. `cache_dir`: a cache of the
  test's own, which all its processes start from in the same state."""
  env = {k: v for k, v in os.environ.items() if k not in JIT_CACHE_VARS}
  if cache_dir is not None:
    env.update(jit_cache_env(cache_dir))
  env.update(extra)
  return env
