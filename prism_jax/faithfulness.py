"""Streaming faithfulness metrics: how much of the decision the prototype path makes.

The logits split exactly, ℓ = W z = W z_hat + W r (PRISM.md §1), but only W z_hat is
explained by prototypes (PRISM.md §3, "Faithfulness"). Over valid tokens t with target y_t:

  proto_ce           CE of W z_hat alone;  proto_ce_ratio = proto_ce / CE of W z
  agreement          share of tokens with argmax(W z_hat) = argmax(W z)
  centred target logit  c(ℓ) = ℓ_y − mean_v ℓ_v, linear in ℓ, so c(W z) = c(W z_hat) + c(W r);
                     centred_proto_share = Σ_t c(W z_hat) / Σ_t c(W z)  (the r share is 1 − it)
  acc_full / acc_proto / acc_resid   top-1 accuracy of W z, W z_hat, W r alone
  decisive_share     share of tokens where the full model is decisive: its top-1 logit
                     leads the top-2 by >= DECISIVE_MARGIN (1) and p(top-1) >= DECISIVE_PROB
                     (0.5); agreement_decisive = the agreement on those tokens alone (nan when
                     there are none). A prototype path that agrees where the model is sure
                     carries its decisions; disagreement on near-ties matters less.

Padding rows of the vocabulary (model.vocab_used; logit PAD_LOGIT) are left out of the
centred logit's mean; they are never an argmax.

Residual logits are W z − W z_hat (exact in value). Argmax ties go to the lower token id.
The state is a NamedTuple of arrays: `update` is pure and jittable, states of disjoint token
sets (batches, hosts) combine with `merge`, `finalize` returns Python floats.

Usage:
  state = faithfulness_init()
  for batch in D:
    out = model(tokens, mask_BxT=mask)
    proto = model.proto_path_logits(out.protos, B, T)
    state = faithfulness_update(state, out.logits_BxTxV.reshape(-1, V),
                                proto.reshape(-1, V), targets.reshape(-1), mask.reshape(-1))
  metrics = faithfulness_finalize(state)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from prism_jax.model.ops import PAD_LOGIT


KEYS = ("full_ce", "proto_ce", "proto_ce_ratio", "agreement", "centred_logit",
        "centred_proto_share", "centred_resid_share", "acc_full", "acc_proto", "acc_resid",
        "decisive_share", "agreement_decisive")
DECISIVE_MARGIN = 1.0  # top-1 minus top-2 logit of W z
DECISIVE_PROB = 0.5  # softmax(W z) of the top-1
LEGEND = ("legend: proto_ce = CE of W z_hat alone (x its ratio to the full CE of W z), "
          "agreement = share of tokens with argmax W z_hat = argmax W z, centred_proto_share "
          "= prototype part of l_y - mean_v l_v, top-1 = accuracy of W z, W z_hat, W r alone, "
          "decisive = tokens where W z's top-1 leads by >= 1 logit with p >= 0.5")


class FaithfulnessState(NamedTuple):
  num_tokens: jax.Array  # int32 (), valid tokens seen
  nll_full: jax.Array  # float32 (), Σ_t −log softmax(W z_t)[y_t]
  nll_proto: jax.Array  # float32 (), Σ_t −log softmax(W z_hat_t)[y_t]
  agree: jax.Array  # int32 (), #t with argmax W z_hat_t = argmax W z_t
  correct_full: jax.Array  # int32 (), #t with argmax W z_t = y_t
  correct_proto: jax.Array  # int32 ()
  correct_resid: jax.Array  # int32 ()
  centred_full: jax.Array  # float32 (), Σ_t c(W z_t)
  centred_proto: jax.Array  # float32 (), Σ_t c(W z_hat_t)
  decisive: jax.Array  # int32 (), #t where W z_t is decisive (see module doc)
  agree_decisive: jax.Array  # int32 (), #t decisive with argmax W z_hat_t = argmax W z_t


def faithfulness_init() -> FaithfulnessState:
  zi, zf = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
  return FaithfulnessState(zi, zf, zf, zi, zi, zi, zi, zf, zf, zi, zi)


def _nll_N(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits_NxV, axis=-1)
  return -jnp.take_along_axis(logp, targets_N[:, None], axis=-1)[:, 0]


def _centred_N(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  target = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
  real_V = logits_NxV[0] > PAD_LOGIT  # padding rows carry PAD_LOGIT in every path
  mean = jnp.sum(jnp.where(real_V, logits_NxV, 0.0), -1) / jnp.maximum(jnp.sum(real_V), 1)
  return target - mean


def decisive_N(logits_NxV: jax.Array) -> jax.Array:
  """Tokens where the logits are decisive: top-1 - top-2 >= DECISIVE_MARGIN and
  softmax top-1 >= DECISIVE_PROB."""
  top2_Nx2 = jax.lax.top_k(logits_NxV, 2)[0]
  p_top1 = jnp.exp(top2_Nx2[:, 0] - jax.nn.logsumexp(logits_NxV, axis=-1))
  return (top2_Nx2[:, 0] - top2_Nx2[:, 1] >= DECISIVE_MARGIN) & (p_top1 >= DECISIVE_PROB)


def faithfulness_update(state: FaithfulnessState, logits_NxV: jax.Array,
                        proto_logits_NxV: jax.Array, targets_N: jax.Array,
                        mask_N: jax.Array | None = None) -> FaithfulnessState:
  """Adds one batch: the model's logits W z, the prototype path's W z_hat, targets, mask."""
  if logits_NxV.ndim != 2 or logits_NxV.shape != proto_logits_NxV.shape:
    raise ValueError(f"logits and proto logits must both be (N, V); got {logits_NxV.shape} "
                     f"and {proto_logits_NxV.shape}")
  n = logits_NxV.shape[0]
  if targets_N.shape != (n,):
    raise ValueError(f"targets must have shape (N,)=({n},), got {targets_N.shape}")
  if mask_N is not None and mask_N.shape != (n,):
    raise ValueError(f"mask must have shape (N,)=({n},), got {mask_N.shape}")
  full = logits_NxV.astype(jnp.float32)
  proto = proto_logits_NxV.astype(jnp.float32)
  resid = full - proto
  targets_N = targets_N.astype(jnp.int32)
  valid_N = jnp.ones(n, bool) if mask_N is None else mask_N.astype(bool)
  validf_N = valid_N.astype(jnp.float32)
  count = lambda b_N: jnp.sum((b_N & valid_N).astype(jnp.int32))
  fsum = lambda x_N: jnp.sum(x_N * validf_N)
  arg_full, arg_proto = jnp.argmax(full, -1), jnp.argmax(proto, -1)
  decisive = decisive_N(full)
  batch = FaithfulnessState(
      num_tokens=count(jnp.ones(n, bool)),
      nll_full=fsum(_nll_N(full, targets_N)), nll_proto=fsum(_nll_N(proto, targets_N)),
      agree=count(arg_proto == arg_full),
      correct_full=count(arg_full == targets_N), correct_proto=count(arg_proto == targets_N),
      correct_resid=count(jnp.argmax(resid, -1) == targets_N),
      centred_full=fsum(_centred_N(full, targets_N)),
      centred_proto=fsum(_centred_N(proto, targets_N)),
      decisive=count(decisive), agree_decisive=count(decisive & (arg_proto == arg_full)))
  return faithfulness_merge(state, batch)


def faithfulness_merge(a: FaithfulnessState, b: FaithfulnessState) -> FaithfulnessState:
  """Combines the states of two disjoint sets of tokens."""
  return FaithfulnessState(*(x + y for x, y in zip(a, b)))


def faithfulness_finalize(state: FaithfulnessState) -> dict[str, float]:
  """Keys: full_ce, proto_ce, proto_ce_ratio, agreement, centred_logit, centred_proto_share,
  centred_resid_share, acc_full, acc_proto, acc_resid, decisive_share, agreement_decisive.
  With no valid token, all are nan."""
  s = jax.device_get(state)
  n = int(s.num_tokens)
  if n == 0:
    return dict.fromkeys(KEYS, float("nan"))
  full_ce, proto_ce = float(s.nll_full) / n, float(s.nll_proto) / n
  c_full, c_proto = float(s.centred_full), float(s.centred_proto)
  share = c_proto / c_full if c_full != 0 else float("nan")
  decisive = int(s.decisive)
  return dict(zip(KEYS, (
      full_ce, proto_ce, proto_ce / full_ce if full_ce > 0 else float("nan"),
      int(s.agree) / n, c_full / n, share, 1.0 - share, int(s.correct_full) / n,
      int(s.correct_proto) / n, int(s.correct_resid) / n, decisive / n,
      int(s.agree_decisive) / decisive if decisive else float("nan"))))


def format_line(metrics: dict[str, float]) -> str:
  """One line for a report, e.g. the demo's."""
  m = metrics
  return (f"proto_ce {m['proto_ce']:.4f} (x{m['proto_ce_ratio']:.3f} of full "
          f"{m['full_ce']:.4f}), agreement {100 * m['agreement']:.1f}%, centred_proto_share "
          f"{m['centred_proto_share']:.3f}, top-1 full/proto/resid {m['acc_full']:.3f}/"
          f"{m['acc_proto']:.3f}/{m['acc_resid']:.3f}, decisive tokens "
          f"{100 * m['decisive_share']:.1f}% (agreement there "
          f"{_percent(m['agreement_decisive'])})")


def _percent(x) -> str:
  """x as a percentage; "n/a" for no decisive token (nan, stored as "nan" in metrics.jsonl
  and read back by a reused run)."""
  v = float(x)
  return "n/a" if v != v else f"{100 * v:.1f}%"

