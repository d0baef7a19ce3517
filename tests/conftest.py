"""Test set-up: CPU only, 8 simulated devices, float64 available for references.

The device count must be set before any JAX backend starts, hence at import time here.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs, each run a few times: LLVM's optimisation
# of XLA:CPU's generated loops costs more than it saves at these sizes (test_ekfac.py: 107
# -> 65 CPU-s). It may change rounding (FMA contraction), so every process of a test uses
# it: the multi-process tests' workers inherit this environment.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# `make test` gives the run a fresh persistent compilation cache (Makefile): on in the pytest
# processes only; a cache hit returns the same executable, so no result changes.
if os.environ.get("PRISM_JAX_TEST_JIT_CACHE"):
  jax.config.update("jax_compilation_cache_dir", os.environ["PRISM_JAX_TEST_JIT_CACHE"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gcs():
  """A local GCS emulator (tests/gcs_emulator.py) for the whole session: its environment
  dict. One per session, since gcsfs caches its client (and the endpoint) per process."""
  import gcs_emulator  # pylint: disable=import-outside-toplevel
  with gcs_emulator.running() as env:
    yield env
