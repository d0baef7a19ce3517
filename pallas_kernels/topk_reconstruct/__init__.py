"""Fused sparse top-k prototype reconstruction (PRISM.md §1) as Pallas kernels."""

from pallas_kernels.topk_reconstruct.api import IMPLEMENTATIONS, resolve_implementation, topk_reconstruct

__all__ = ["IMPLEMENTATIONS", "resolve_implementation", "topk_reconstruct"]
