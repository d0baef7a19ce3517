"""The PRISM prototype layer as a pure function on arrays, plus a thin NNX wrapper.

    s_NxK   = cos(z_NxD, protos_KxD)            computed once
    idx_Nxk = top-k of s per row                ties go to the lower prototype id
    act_Nxk = ReLU(s[idx])                      (optionally normalised to sum to 1; or,
                                                 mixture "nnls", the non-negative
                                                 least-squares fit of z on p[idx]: nnls.py)
    z_hat   = sum_j act_j protos[idx_j]
    r       = z - stop_gradient(z_hat)          (straight-through, default) | z - z_hat

The per-row / per-column similarity extrema that R1, R2 and the grounding metrics need
are returned so the N x K matrix is never recomputed.

The maths and its implementations (XLA, Pallas kernels, mesh paths) are the op in
pallas_kernels/topk_reconstruct; this module validates inputs, routes the op to the mesh
axes of prism_jax.sharding's rules table, and applies the residual routing. The op's
pure functions the library uses are re-exported here, so each exists once.
"""

from __future__ import annotations

import typing
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.topk_reconstruct import api
from pallas_kernels.topk_reconstruct.api import IMPLEMENTATIONS
from pallas_kernels.topk_reconstruct.reference import (  # re-exported: the one definition
    EPS, Similarity, first_extremum, first_max, first_min, inv_norm, mixture_weights, similarity,
    sparse_mixture, topk_mixture, topk_reconstruct_xla)
from prism_jax import sharding
from prism_jax.config import Mixture
from prism_jax.model import nnls
from prism_jax.model.params import normal_param

__all__ = ["EPS", "IMPLEMENTATIONS", "PrototypeBank", "PrototypeOutput", "Similarity",
           "first_extremum", "first_max", "first_min", "inv_norm", "mixture_weights", "prototype_layer",
           "route_residual", "similarity", "sparse_mixture", "topk_mixture", "topk_reconstruct_on_mesh",
           "topk_reconstruct_xla", "validate_inputs"]


MIXTURES = typing.get_args(Mixture)  # "raw", "normalized", "nnls": the config's one list


class PrototypeOutput(NamedTuple):
  """Result of `prototype_layer` for N tokens, K prototypes, k active."""

  idx_Nxk: jax.Array  # int32 active prototype ids, by decreasing similarity
  act_Nxk: jax.Array  # mixture weights used in z_hat (non-negative)
  sim_Nxk: jax.Array  # cosine similarity of each active prototype
  z_hat_NxD: jax.Array  # reconstruction
  residual_NxD: jax.Array  # z - z_hat (gradient routing per option)
  row_max_cos_N: jax.Array  # max_i cos(z_t, p_i)
  col_max_cos_K: jax.Array  # max over valid tokens of cos(p_i, z_t); -inf if none valid
  row_min_dist_N: jax.Array  # min_i dist(z_t, p_i) for the configured distance
  col_min_dist_K: jax.Array  # min over valid tokens of dist(p_i, z_t); +inf if none valid


def validate_inputs(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                    residual_routing: str, mixture: str, distance: str,
                    implementation: str | None, mask_N: jax.Array | None) -> None:
  if z_NxD.ndim != 2 or protos_KxD.ndim != 2:
    raise ValueError(f"prototype_layer expects z of shape (N, D) and protos of shape (K, D); "
                     f"got {z_NxD.shape} and {protos_KxD.shape}")
  if z_NxD.shape[1] != protos_KxD.shape[1]:
    raise ValueError(f"feature sizes differ: z has D={z_NxD.shape[1]}, "
                     f"protos has D={protos_KxD.shape[1]}")
  for name, x in (("z", z_NxD), ("protos", protos_KxD)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
  num_protos = protos_KxD.shape[0]
  if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_protos:
    raise ValueError(f"k must be an int in [1, K={num_protos}], got {k!r}")
  if residual_routing not in ("straight_through", "plain"):
    raise ValueError(f"residual_routing={residual_routing!r}; use 'straight_through' or 'plain'")
  if mixture not in MIXTURES:
    raise ValueError(f"mixture={mixture!r}; use one of {', '.join(MIXTURES)}")
  if distance not in ("cosine", "sqeuclidean"):
    raise ValueError(f"distance={distance!r}; use 'cosine' or 'sqeuclidean'")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; use one of {IMPLEMENTATIONS}")
  if mask_N is not None and mask_N.shape != (z_NxD.shape[0],):
    raise ValueError(f"mask must have shape (N,)=({z_NxD.shape[0]},), got {mask_N.shape}")


def prototype_layer(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                    residual_routing: str = "straight_through", mixture: str = "raw",
                    distance: str = "cosine", implementation: str | None = None,
                    mask_N: jax.Array | None = None) -> PrototypeOutput:
  """Sparse non-negative prototype mixture of PRISM.md §1 (see module docstring).

  Outputs are float32 whatever the input dtype.

  Args:
    z_NxD: hidden states of N tokens, (N, D), any floating dtype.
    protos_KxD: the prototype bank P, (K, D), floating, same D as `z_NxD`.
    k: active prototypes per token, an int in [1, K].
    residual_routing: "straight_through" (default: r = z - stop_gradient(z_hat), so the
      CE reaches the bank only through z_hat) or "plain" (r = z - z_hat).
    mixture: "raw" (default: act = ReLU(cos) of the k active prototypes), "normalized"
      (those activations divided by their sum, so each row sums to 1) or "nnls" (the
      non-negative least-squares fit of z on the k active prototypes: model/nnls.py).
    distance: the distance of the `*_min_dist` outputs: "cosine" (default: 1 - cos) or
      "sqeuclidean" (squared Euclidean distance).
    implementation: the op's kernel, one of `IMPLEMENTATIONS`: None (default) picks the
      best for the platform the program is compiled for; "xla" is the reference.
    mask_N: bool (N,) marking valid tokens (padding/EOS excluded): only they enter the
      per-prototype (column) statistics used by R1. None (default): every token is valid.

  Returns:
    A `PrototypeOutput`: the active ids `idx_Nxk` (int32, by decreasing similarity, ties to
    the lower id), their activations `act_Nxk` and cosines `sim_Nxk`, all (N, k); the
    reconstruction `z_hat_NxD` and the routed residual `residual_NxD`, (N, D); the
    per-token `row_max_cos_N` and `row_min_dist_N`, (N,); the per-prototype
    `col_max_cos_K` (-inf with no valid token) and `col_min_dist_K` (+inf with none), (K,).
  """
  validate_inputs(z_NxD, protos_KxD, k, residual_routing=residual_routing, mixture=mixture,
                  distance=distance, implementation=implementation, mask_N=mask_N)
  (idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist,
   col_min_dist) = topk_reconstruct_on_mesh(z_NxD, protos_KxD, k,
                                            mixture="raw" if mixture == "nnls" else mixture,
                                            distance=distance, mask_N=mask_N,
                                            implementation=implementation)
  if mixture == "nnls":  # the op's selection and statistics; the weights fitted after it
    act, z_hat = nnls.nnls_mixture(z_NxD, protos_KxD, idx)
  residual = route_residual(z_NxD.astype(z_hat.dtype), z_hat, residual_routing)
  return PrototypeOutput(idx, act, sim, z_hat, residual, row_max_cos, col_max_cos,
                         row_min_dist, col_min_dist)


def topk_reconstruct_on_mesh(z_NxD, protos_KxD, k, *, mixture="raw", distance="cosine",
                             mask_N=None, implementation=None):
  """The op with the mesh axes of the rules table: the bank may be split over the axis
  of "proto", the tokens over those of "tokens" (the op picks its mesh path)."""
  (model_axis,) = sharding.mesh_axes("proto")
  return api.topk_reconstruct(z_NxD, protos_KxD, k, mixture=mixture, distance=distance,
                              mask_N=mask_N, implementation=implementation,
                              token_axes=sharding.mesh_axes("tokens"), model_axis=model_axis)


def route_residual(z_NxD: jax.Array, z_hat_NxD: jax.Array, residual_routing: str):
  """r = z - stop_gradient(z_hat) (straight-through: CE reaches the bank only through
  z_hat) or z - z_hat (plain)."""
  if residual_routing == "straight_through":
    return z_NxD - jax.lax.stop_gradient(z_hat_NxD)
  return z_NxD - z_hat_NxD


class PrototypeBank(nnx.Module):
  """Holds the bank P (K x D, logical axes ("proto", "embed")) and applies the layer."""

  def __init__(self, num_prototypes: int, d_model: int, k: int, *, rngs: nnx.Rngs,
               residual_routing: str = "straight_through", mixture: str = "raw",
               distance: str = "cosine", implementation: str | None = None):
    if not 1 <= k <= num_prototypes:
      raise ValueError(f"k must be in [1, K={num_prototypes}], got {k}")
    self.k = k
    self.residual_routing = residual_routing
    self.mixture = mixture
    self.distance = distance
    self.implementation = implementation
    self.protos = normal_param(rngs, (num_prototypes, d_model), 1.0, ("proto", "embed"))

  def __call__(self, z_NxD: jax.Array, mask_N: jax.Array | None = None) -> PrototypeOutput:
    return prototype_layer(z_NxD, self.protos[...], self.k,
                           residual_routing=self.residual_routing, mixture=self.mixture,
                           distance=self.distance, implementation=self.implementation,
                           mask_N=mask_N)
