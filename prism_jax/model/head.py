"""The PRISM head as one pure function of arrays (PRISM.md §1).

    prototype layer   idx, a, ẑ = Σ_j a_j p_idx_j, r       (prototypes.prototype_layer)
    learned scale     a → s a, ẑ → s ẑ, r → z − s ẑ          (mixture_scale="learned")
    tap "bank"        ẑ → ẑ + probe, a (B, T, K) recorded    (model/tap.py)
    residual keep     r → 0 on dropped tokens                (residual dropout, training)
    logits            W (r + ẑ)                              (transformer.tied_logits)

`PrismLM.head` is this function on its parameters; attribution, the Hessian blocks and
control call it with the bank P (and the mixture scale) as explicit arguments, so that
they differentiate the model's own head w.r.t. P. `fixed_weights` holds the mixture
weights a fixed (P reaches ẑ only through the explicit rows p_i: the linear-layer view
of PRISM.md §4 that the attribution cache and K-FAC model).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from prism_jax.config import ModelConfig
from prism_jax.model.prototypes import (PrototypeOutput, prototype_layer, route_residual,
                                        sparse_mixture)
from prism_jax.model.tap import Tap, linear
from prism_jax.model.ops import tied_logits


class HeadOutput(NamedTuple):
  logits: jax.Array  # (B, T, V), or (N, V) for z of shape (N, D); at least fp32
  protos: PrototypeOutput  # flattened over the N = B*T tokens


def mixture_scale(cfg: ModelConfig, mix_log_scale: jax.Array | None) -> jax.Array:
  """s = exp(mix_log_scale) with `mixture_scale="learned"`, else 1."""
  if cfg.mixture_scale != "learned":
    return jnp.ones((), jnp.float32)
  if mix_log_scale is None:
    raise ValueError("model.mixture_scale='learned' needs mix_log_scale (the model's "
                     "PrismLM.mix_log_scale)")
  return jnp.exp(mix_log_scale)


def prism_head(z_BxTxD: jax.Array, protos_KxD: jax.Array, wte_VxD: jax.Array,
               cfg: ModelConfig, *, mix_log_scale: jax.Array | None = None,
               mask_N: jax.Array | None = None, tap: Tap | None = None,
               residual_keep_N: jax.Array | None = None, fixed_weights: bool = False,
               implementation: str | None = None) -> HeadOutput:
  """Logits and the decomposition from the final hidden state z, (B, T, D) or (N, D).

  cfg gives k, residual_routing, mixture, distance, mixture_scale and the logits' dtype;
  `implementation` the prototype layer's kernel (None: the best available; "xla" is
  autodiff end to end, forward mode too, as jax.hessian needs). `mask_N` marks the valid
  tokens of the per-prototype statistics; `residual_keep_N` (training only) drops r_t
  from the logits where False; `fixed_weights` stops the gradient through a."""
  flat = z_BxTxD.ndim == 2
  z_BxTxD = z_BxTxD[None] if flat else z_BxTxD
  batch, seq, d = z_BxTxD.shape
  z_NxD = z_BxTxD.reshape(batch * seq, d)
  protos = prototype_layer(z_NxD, protos_KxD, cfg.k, residual_routing=cfg.residual_routing,
                           mixture=cfg.mixture, distance=cfg.distance,
                           implementation=implementation, mask_N=mask_N)
  if cfg.mixture_scale == "learned":
    protos = _scale_mixture(protos, mixture_scale(cfg, mix_log_scale), cfg.residual_routing)
  if fixed_weights:  # ẑ = Σ_j sg(a_j) p_idx_j: the same value, P enters through the rows
    act_Nxk = jax.lax.stop_gradient(protos.act_Nxk)
    z_hat_NxD = sparse_mixture(act_Nxk, protos.idx_Nxk, protos_KxD.astype(act_Nxk.dtype))
    protos = protos._replace(act_Nxk=act_Nxk, z_hat_NxD=z_hat_NxD, residual_NxD=route_residual(
        z_NxD.astype(z_hat_NxD.dtype), z_hat_NxD, cfg.residual_routing))
  residual_NxD, z_hat_NxD = protos.residual_NxD, protos.z_hat_NxD
  if tap is not None and "bank" in tap.probes:
    rows_Nx1 = jnp.arange(batch * seq)[:, None]
    a_NxK = jnp.zeros((batch * seq, protos_KxD.shape[0]), protos.act_Nxk.dtype)
    z_hat_NxD = linear(tap, "bank", a_NxK.at[rows_Nx1, protos.idx_Nxk].set(protos.act_Nxk),
                       z_hat_NxD, bias=False)
    if cfg.residual_routing != "straight_through":
      residual_NxD = residual_NxD - (z_hat_NxD - protos.z_hat_NxD)  # r = z - (ẑ + probe)
  if residual_keep_N is not None:
    residual_NxD = residual_NxD * residual_keep_N.reshape(-1, 1).astype(residual_NxD.dtype)
  if cfg.residual_routing == "straight_through" and residual_keep_N is None:
    # r + ẑ with r = z − sg(ẑ), written so that the value is z to the bit (the logits are
    # W z exactly, as the dense twin's: a frozen retrofit predicts as its dense model) and
    # the gradients are those of r + ẑ.
    head_in_NxD = z_NxD.astype(z_hat_NxD.dtype) + (z_hat_NxD - jax.lax.stop_gradient(z_hat_NxD))
  else:
    head_in_NxD = residual_NxD + z_hat_NxD  # = z in value; routes gradients
  logits = tied_logits(head_in_NxD.reshape(batch, seq, d), wte_VxD, cfg.dtype,
                       cfg.num_token_ids)
  return HeadOutput(logits[0] if flat else logits, protos)


def _scale_mixture(protos: PrototypeOutput, scale: jax.Array,
                   residual_routing: str) -> PrototypeOutput:
  """z_hat -> s z_hat (and a -> s a, so the decomposition stays exact); r follows the
  layer's routing: z - sg(s z_hat) straight-through, z - s z_hat plain."""
  delta_NxD = (1.0 - scale) * protos.z_hat_NxD
  if residual_routing == "straight_through":
    delta_NxD = jax.lax.stop_gradient(delta_NxD)
  return protos._replace(act_Nxk=scale * protos.act_Nxk, z_hat_NxD=scale * protos.z_hat_NxD,
                         residual_NxD=protos.residual_NxD + delta_NxD)
