"""Fused sparse top-k prototype reconstruction (PRISM.md §1) as a self-contained op: the
pure maths and XLA oracle (reference.py), Pallas kernels with sparse custom_vjps, and the
mesh paths (sharded.py). Imports nothing from prism_jax."""

from pallas_kernels.topk_reconstruct.api import IMPLEMENTATIONS, resolve_implementation, topk_reconstruct

__all__ = ["IMPLEMENTATIONS", "resolve_implementation", "topk_reconstruct"]
