"""Static options of the Pallas kernels (block sizes, backend, GPU precision and launch)."""

from __future__ import annotations

from typing import NamedTuple


class KernelOptions(NamedTuple):
  """Static kernel choices (hashable: a custom_vjp non-differentiable argument)."""
  distance: str = "cosine"
  backend: str = "tpu"  # "tpu" | "gpu" | "xla" (no kernel: the dense similarity, vjp.py)
  interpret: bool = False
  block_n: int | None = None
  block_k: int | None = None
  block_d: int | None = None  # GPU only
  precision: str = "tf32x3"  # GPU fp32 only: "tf32x3" | "ieee" | "tf32"
  num_warps: int | None = None  # GPU only; None: gpu.default_config(dtype)
  num_stages: int | None = None  # GPU only; None: gpu.default_config(dtype)
