"""The four-term PRISM objective (PRISM.md §2) as pure functions.

  L = CE + λ_rec REC + λ_1 R1 + λ_2 R2  [+ λ_proto CE(W z_hat) + λ_rlogit RLOGIT
                                          + λ_proto_kl PKL: issue 11, beyond the paper]
  CE  = mean_t -log softmax(ℓ_t)[y_t]
  REC = mean_t ‖r_t‖² / ‖z_t‖²        (relative; plain ‖r_t‖² as an option)
  R1  = mean_i min_t dist(p_i, z_t)   every prototype near some real token of the batch
  R2  = mean_t min_i dist(z_t, p_i)   every token near some prototype
  RLOGIT = mean_t var_v((W r_t)_v) / var_v(ℓ_t,v)   the residual's share of the logit spread
  PKL = mean_t KL(sg(softmax ℓ_t) ‖ softmax W z_hat_t)  the prototype path towards the model

All means run over valid tokens only (mask_N is False on padding/EOS). R1 needs the column
minima over the *whole global batch*: pass them already reduced across data shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prism_jax.config import LossConfig
from prism_jax.model.lm import LMOutput
from prism_jax.model.prototypes import EPS, PrototypeOutput


def _masked_mean(x_N: jax.Array, mask_N: jax.Array) -> jax.Array:
  mask = mask_N.astype(jnp.float32)
  return jnp.sum(x_N * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  """Per-token cross-entropy -log softmax(ℓ_t)[y_t], unmasked, in (at least) float32
  (float64 logits stay float64). Any leading shape: (..., V) logits, (...) targets. The one
  definition: the training loss, eval, EK-FAC and the curvature references use it."""
  logits = logits_NxV.astype(jnp.promote_types(logits_NxV.dtype, jnp.float32))
  # logsumexp - the target's logit, picked by an iota comparison rather than a gather: the
  # gradient (softmax - one-hot) is then elementwise and fuses, where take_along_axis's is
  # a scatter into a zeroed N x V buffer. The pick is exact (a sum of one logit and zeros).
  vocab_iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  hit = vocab_iota == targets_N[..., None].astype(jnp.int32)
  target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
  return jax.nn.logsumexp(logits, axis=-1) - target_logit


def cross_entropy(logits_NxV: jax.Array, targets_N: jax.Array, mask_N: jax.Array) -> jax.Array:
  return _masked_mean(token_nll(logits_NxV, targets_N), mask_N)


def token_rec(z_NxD: jax.Array, residual_NxD: jax.Array, kind: str = "relative") -> jax.Array:
  """Per-token REC ‖r_t‖² / ‖z_t‖² (relative) or ‖r_t‖² (plain), unmasked, in (at least)
  float32 (float64 stays float64, for the curvature references)."""
  wide = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
  sq_r_N = jnp.sum(jnp.square(wide(residual_NxD)), axis=-1)
  if kind == "relative":
    sq_r_N = sq_r_N / jnp.maximum(jnp.sum(jnp.square(wide(z_NxD)), -1), EPS)
  elif kind != "plain":
    raise ValueError(f"rec kind {kind!r}; use 'relative' or 'plain'")
  return sq_r_N


def reconstruction(z_NxD: jax.Array, residual_NxD: jax.Array, mask_N: jax.Array,
                   kind: str = "relative") -> jax.Array:
  return _masked_mean(token_rec(z_NxD, residual_NxD, kind), mask_N)


def r1_clustering(col_min_dist_K: jax.Array) -> jax.Array:
  """Mean over prototypes of the distance to their nearest valid token.

  Prototypes with no valid token in the batch (all-padding batch) carry +inf and are skipped.
  """
  finite = jnp.isfinite(col_min_dist_K)
  vals = jnp.where(finite, col_min_dist_K, 0.0)
  return jnp.sum(vals) / jnp.maximum(jnp.sum(finite), 1)


def r2_clustering(row_min_dist_N: jax.Array, mask_N: jax.Array) -> jax.Array:
  return _masked_mean(row_min_dist_N, mask_N)


def residual_logit_share(logits_NxV: jax.Array, proto_logits_NxV: jax.Array,
                         mask_N: jax.Array) -> jax.Array:
  """RLOGIT: mean_t var_v((W r_t)_v) / var_v(ℓ_t,v), with W r = ℓ − W z_hat (exact in value:
  no second head). Centring is inside the variance, so a shift common to all logits, which
  no softmax sees, costs nothing. As REC under straight-through routing, the gradient
  moves z (and W) towards the mixture, not the bank."""
  logits = logits_NxV.astype(jnp.float32)
  var_r_N = jnp.var(logits - proto_logits_NxV.astype(jnp.float32), axis=-1)
  return _masked_mean(var_r_N / jnp.maximum(jnp.var(logits, axis=-1), EPS), mask_N)


def proto_kl(logits_NxV: jax.Array, proto_logits_NxV: jax.Array,
             mask_N: jax.Array) -> jax.Array:
  """PKL: mean_t KL(p_t ‖ q_t), p = softmax of the model's logits ℓ (stop-gradient: the
  full model is the teacher, not moved), q = softmax W z_hat. Zero where the prototype path
  predicts the model's whole distribution, its argmax included."""
  logp_NxV = jax.nn.log_softmax(jax.lax.stop_gradient(logits_NxV.astype(jnp.float32)), -1)
  logq_NxV = jax.nn.log_softmax(proto_logits_NxV.astype(jnp.float32), -1)
  return _masked_mean(jnp.sum(jnp.exp(logp_NxV) * (logp_NxV - logq_NxV), -1), mask_N)


def rec_weight(cfg: LossConfig, step: jax.Array | int | None) -> jax.Array | float:
  """λ_rec at `step`: constant, or ramped linearly from 0 over `rec_ramp_steps`."""
  if cfg.rec_ramp_steps == 0 or step is None:
    return cfg.lambda_rec
  frac = jnp.minimum(jnp.asarray(step, jnp.float32) / cfg.rec_ramp_steps, 1.0)
  return cfg.lambda_rec * frac


def total_loss(out: LMOutput, targets_BxT: jax.Array, mask_BxT: jax.Array,
               cfg: LossConfig, *, step: jax.Array | int | None = None,
               proto_logits_BxTxV: jax.Array | None = None,
               share: dict[str, jax.Array] | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Weighted objective and a metrics dict (all scalars, fp32). Dense models get CE only.

  `step` sets λ_rec when it is ramped; `proto_logits_BxTxV` (W z_hat, from
  `PrismLM.proto_path_logits`) is needed when `cfg.needs_proto_logits` (λ_proto,
  λ_rlogit or λ_proto_kl > 0).
  `share` (gradient accumulation, prism_jax/train/accumulate.py): this microbatch's share
  of a batch, {"weight": its fraction of the batch's valid tokens, "r1_owner_K": the
  prototypes whose nearest token of the whole batch is in it, "r1_count": the prototypes
  with any valid token in the batch; other keys are the caller's}; the loss and metrics
  returned are then the microbatch's shares, which sum over the microbatches to the whole
  batch's values.
  """
  batch, seq, vocab = out.logits_BxTxV.shape
  mask_N, targets_N = mask_BxT.reshape(batch * seq), targets_BxT.reshape(-1)
  logits_NxV = out.logits_BxTxV.reshape(-1, vocab)
  ce = cross_entropy(logits_NxV, targets_N, mask_N)
  metrics = {"ce": ce}
  loss = ce
  if out.protos is not None:
    p: PrototypeOutput = out.protos
    z_NxD = out.z_BxTxD.reshape(batch * seq, -1)
    rec = reconstruction(z_NxD, p.residual_NxD, mask_N, cfg.rec_kind)
    r1 = r1_clustering(p.col_min_dist_K)
    r2 = r2_clustering(p.row_min_dist_N, mask_N)
    loss = ce + rec_weight(cfg, step) * rec + cfg.lambda_r1 * r1 + cfg.lambda_r2 * r2
    if cfg.needs_proto_logits:
      if proto_logits_BxTxV is None:
        lever = next(n for n in cfg.PROTO_LOGIT_TERMS if getattr(cfg, n) > 0)
        raise ValueError(f"loss.{lever} > 0 needs proto_logits_BxTxV (W z_hat)")
      proto_NxV = proto_logits_BxTxV.reshape(-1, vocab)
    if cfg.lambda_proto > 0:
      ce_proto = cross_entropy(proto_NxV, targets_N, mask_N)
      loss = loss + cfg.lambda_proto * ce_proto
      metrics["proto_ce"] = ce_proto
    if cfg.lambda_rlogit > 0:
      rlogit = residual_logit_share(logits_NxV, proto_NxV, mask_N)
      loss = loss + cfg.lambda_rlogit * rlogit
      metrics["rlogit"] = rlogit
    if cfg.lambda_proto_kl > 0:
      pkl = proto_kl(logits_NxV, proto_NxV, mask_N)
      loss = loss + cfg.lambda_proto_kl * pkl
      metrics["proto_kl"] = pkl
    sq_r = _masked_mean(jnp.sum(jnp.square(p.residual_NxD), -1), mask_N)
    sq_z = _masked_mean(jnp.sum(jnp.square(z_NxD), -1), mask_N)
    metrics.update(rec=rec, r1=r1, r2=r2, residual_share=sq_r / jnp.maximum(sq_z, EPS),
                   mean_active=_masked_mean(jnp.sum(p.act_Nxk > 0, -1).astype(jnp.float32),
                                            mask_N))
  metrics["loss"] = loss
  if share is None:
    return loss, metrics
  # every term is a mean over valid tokens, except R1: a mean over prototypes of a
  # minimum over the whole batch's tokens, each prototype's owned by one microbatch
  weight = share["weight"]
  out_metrics = {k: weight * v for k, v in metrics.items()}
  loss = weight * loss
  if out.protos is not None:
    col = out.protos.col_min_dist_K
    r1_share = (jnp.sum(jnp.where(share["r1_owner_K"], jnp.where(jnp.isfinite(col), col, 0.0),
                                  0.0)) / jnp.maximum(share["r1_count"], 1.0))
    loss = loss + cfg.lambda_r1 * (r1_share - weight * metrics["r1"])
    out_metrics["r1"] = r1_share
  out_metrics["loss"] = loss
  return loss, out_metrics
