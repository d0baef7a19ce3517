"""Per-token trust: did the prototype path pick the prediction, and how much of its lead?

The logits split exactly, ℓ = W ẑ + W r (PRISM.md §1), but only W ẑ is explained by
prototypes. For a token with full logits ℓ = W z and prototype-path logits ℓ̂ = W ẑ:

  top1, runner_up  the two largest logits of ℓ: the prediction and its closest rival
                   (ties go to the lower token id, as `jax.lax.top_k` and argmax order them)
  proto_top1       argmax ℓ̂ (ties: the lower id)
  agrees           proto_top1 == top1: the prototypes alone predict the same token
  margin           ℓ[top1] − ℓ[runner_up] ≥ 0, the prediction's lead
  proto_share      (ℓ̂[top1] − ℓ̂[runner_up]) / margin: the prototypes' part of that lead
                   (the residual's is 1 − proto_share; > 1 when the residual worked against
                   the prediction, < 0 when the prototypes did; nan on an exact tie)

A token whose prototypes do not agree was decided by the residual: its prototype
explanation does not explain why the model chose it (say so, and point to a method that
explains the whole model: EK-FAC or gradient dot-products). Padding rows of the vocabulary
hold PAD_LOGIT in both logits and are never chosen.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# What a reader is told when the residual, not the prototypes, decided a token.
RESIDUAL_DECIDED = ("the residual, not the prototypes, decided this prediction (argmax "
                    "W z_hat != argmax W z): its prototypes do not explain it; a method over "
                    "the whole model does: EK-FAC or gradient dot-products "
                    "(prism_jax.attribution.quality.methods 'ekfac' / 'grad_dot')")


class Trust(NamedTuple):
  top1_N: jax.Array  # int32, argmax W z
  runner_up_N: jax.Array  # int32, the second largest logit of W z
  proto_top1_N: jax.Array  # int32, argmax W z_hat
  agrees_N: jax.Array  # bool, proto_top1 == top1
  margin_N: jax.Array  # float32, l[top1] - l[runner_up] >= 0
  proto_share_N: jax.Array  # float32, the prototypes' part of the margin (nan: a tie)


def token_trust(logits_NxV: jax.Array, proto_logits_NxV: jax.Array) -> Trust:
  """Trust of each token from its full logits W z and its prototype-path logits W z_hat."""
  logits = jnp.asarray(logits_NxV, jnp.float32)
  proto = jnp.asarray(proto_logits_NxV, jnp.float32)
  vals_Nx2, ids_Nx2 = jax.lax.top_k(logits, 2)
  top1, runner = ids_Nx2[:, 0], ids_Nx2[:, 1]
  proto_top1 = jnp.argmax(proto, axis=-1).astype(jnp.int32)
  margin = vals_Nx2[:, 0] - vals_Nx2[:, 1]
  take = lambda x, i: jnp.take_along_axis(x, i[:, None], axis=-1)[:, 0]
  proto_margin = take(proto, top1) - take(proto, runner)
  share = jnp.where(margin > 0, proto_margin / jnp.where(margin > 0, margin, 1.0), jnp.nan)
  return Trust(top1.astype(jnp.int32), runner.astype(jnp.int32), proto_top1,
               proto_top1 == top1, margin, share)


def output_trust(model, out) -> Trust:
  """Trust of every token of a PrismLM forward `out` (an LMOutput), flattened to N = B*T."""
  batch, seq, vocab = out.logits_BxTxV.shape
  proto = model.proto_path_logits(out.protos, batch, seq)
  return token_trust(out.logits_BxTxV.reshape(-1, vocab), proto.reshape(-1, vocab))


def prediction_trust(model, tokens_T, positions) -> Trust:
  """Trust of the model's prediction at each position p of `positions` (the next-token
  prediction made from tokens[:p], whose target is tokens[p]): one forward of
  tokens[:max p], as numpy arrays."""
  tokens_T = np.asarray(tokens_T, np.int32).reshape(-1)
  positions = np.asarray(positions, np.int64).reshape(-1)
  if not len(positions) or positions.min() < 1 or positions.max() >= len(tokens_T) + 1:
    raise ValueError(f"positions must lie in [1, {len(tokens_T)}] (a prediction needs at "
                     f"least one token before it), got {positions.tolist()}")
  out = model(jnp.asarray(tokens_T[None, :positions.max()]))
  trust = output_trust(model, out)
  return Trust(*(np.asarray(x)[positions - 1] for x in trust))


def carriers_N(contrib_Nxk: np.ndarray, fraction: float = 0.9) -> np.ndarray:
  """How many prototypes carry `fraction` of each token's prototype logit: the fewest of
  its active prototypes whose |contribution| sums to `fraction` of the total |contribution|
  (0 for a token whose prototypes contribute nothing). The size of an explanation a reader
  must take in."""
  mag = np.sort(np.abs(np.asarray(contrib_Nxk, np.float64)), axis=-1)[:, ::-1]
  total = mag.sum(-1, keepdims=True)
  reached = np.cumsum(mag, axis=-1) >= fraction * total - 1e-12 * total
  return np.where(total[:, 0] > 0, np.argmax(reached, axis=-1) + 1, 0)


def trust_label(agrees: bool, proto_share: float) -> str:
  """One short mark for a token: 'proto 87%' (the prototypes pick it, with their share of
  the lead) or 'residual' (the residual decided it)."""
  if not agrees:
    return "residual"
  return "proto" if not np.isfinite(proto_share) else f"proto {100 * proto_share:.0f}%"
