"""Test set-up: CPU only, 8 simulated devices, float64 available for references.

The device count must be set before any JAX backend starts, hence at import time here.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gcs():
  """A local GCS emulator (tests/gcs_emulator.py) for the whole session: its environment
  dict. One per session, since gcsfs caches its client (and the endpoint) per process."""
  import gcs_emulator  # pylint: disable=import-outside-toplevel
  with gcs_emulator.running() as env:
    yield env
