"""Test set-up: CPU only, 8 simulated devices, float64 available for references.

The device count must be set before any JAX backend starts, hence at import time here.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
