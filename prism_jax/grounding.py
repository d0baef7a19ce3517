"""Streaming grounding metrics of a prototype bank over a held-out corpus D (PRISM.md §3).

  R̄1 = mean_i max_{t∈D} cos(p_i, z_t)     prototypes sit on real data
  R̄2 = mean_{t∈D} max_i cos(z_t, p_i)     tokens are covered by the bank
  residual share = E‖r_t‖² / E‖z_t‖²
  usage_i = #tokens with i in their top-k AND a_{t,i} > 0;  dead = #{i : usage_i = 0}

Only valid tokens (mask True) count. The state is a NamedTuple of arrays, so `update` is a
pure jittable function and states from different batches (or hosts) combine with `merge`.

Usage:
  state = grounding_init(K)
  for batch in D:
    out = model(tokens, mask_BxT=mask)        # the mask must reach the prototype layer too:
    state = grounding_update(state, out.protos, out.z_BxTxD.reshape(-1, D),
                             mask.reshape(-1))  # col_max_cos_K is masked there
  metrics = grounding_finalize(state)

Sums are float32 and counts int32 (exact up to 2**31 tokens; float sums keep ~6 digits).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.model.prototypes import PrototypeOutput


class GroundingState(NamedTuple):
  num_tokens: jax.Array  # int32 (), valid tokens seen
  sum_row_max_cos: jax.Array  # float32 (), Σ_t max_i cos(z_t, p_i)
  col_max_cos_K: jax.Array  # float32 (K,), max_t cos(p_i, z_t); -inf before any token
  sum_sq_residual: jax.Array  # float32 (), Σ_t ‖r_t‖²
  sum_sq_z: jax.Array  # float32 (), Σ_t ‖z_t‖²
  usage_K: jax.Array  # int32 (K,), active (top-k with a > 0) token count per prototype


def grounding_init(num_prototypes: int) -> GroundingState:
  if not isinstance(num_prototypes, int) or num_prototypes <= 0:
    raise ValueError(f"num_prototypes must be a positive int, got {num_prototypes!r}")
  zero = jnp.zeros((), jnp.float32)
  return GroundingState(jnp.zeros((), jnp.int32), zero,
                        jnp.full((num_prototypes,), -jnp.inf, jnp.float32), zero, zero,
                        jnp.zeros((num_prototypes,), jnp.int32))


def grounding_update(state: GroundingState, protos: PrototypeOutput, z_NxD: jax.Array,
                     mask_N: jax.Array | None = None) -> GroundingState:
  """Adds one batch. `protos` must come from the layer called with the same `mask_N`."""
  num_protos = state.usage_K.shape[0]
  if protos.col_max_cos_K.shape != (num_protos,):
    raise ValueError(f"state tracks K={num_protos} prototypes but the batch has "
                     f"{protos.col_max_cos_K.shape[0]}")
  n = z_NxD.shape[0]
  if protos.idx_Nxk.shape[0] != n:
    raise ValueError(f"protos cover {protos.idx_Nxk.shape[0]} tokens but z has {n}")
  valid_N = jnp.ones(n, bool) if mask_N is None else mask_N.reshape(n).astype(bool)
  validf_N = valid_N.astype(jnp.float32)
  sq_z_N = jnp.sum(jnp.square(z_NxD.astype(jnp.float32)), -1)
  sq_r_N = jnp.sum(jnp.square(protos.residual_NxD.astype(jnp.float32)), -1)
  active_Nxk = (protos.act_Nxk > 0) & valid_N[:, None]
  usage_K = jnp.zeros(num_protos, jnp.int32).at[protos.idx_Nxk.reshape(-1)].add(
      active_Nxk.reshape(-1).astype(jnp.int32))
  batch = GroundingState(
      num_tokens=jnp.sum(valid_N.astype(jnp.int32)),
      sum_row_max_cos=jnp.sum(protos.row_max_cos_N * validf_N),
      col_max_cos_K=protos.col_max_cos_K.astype(jnp.float32),
      sum_sq_residual=jnp.sum(sq_r_N * validf_N),
      sum_sq_z=jnp.sum(sq_z_N * validf_N),
      usage_K=usage_K)
  return grounding_merge(state, batch)


def grounding_merge(a: GroundingState, b: GroundingState) -> GroundingState:
  """Combines the states of two disjoint sets of tokens (batches, hosts, shards)."""
  return GroundingState(a.num_tokens + b.num_tokens, a.sum_row_max_cos + b.sum_row_max_cos,
                        jnp.maximum(a.col_max_cos_K, b.col_max_cos_K),
                        a.sum_sq_residual + b.sum_sq_residual, a.sum_sq_z + b.sum_sq_z,
                        a.usage_K + b.usage_K)


def grounding_finalize(state: GroundingState) -> dict[str, Any]:
  """Python floats/ints plus the usage histogram (numpy int64, length K).

  Keys: r1_bar, r2_bar, residual_share, dead (count), dead_frac, num_tokens, usage.
  With no valid token the means are nan.
  """
  s = jax.device_get(state)
  num_tokens = int(s.num_tokens)
  usage = np.asarray(s.usage_K, np.int64)
  nan = float("nan")
  dead = int(np.sum(usage == 0))
  return {
      "r1_bar": float(np.mean(s.col_max_cos_K, dtype=np.float64)) if num_tokens else nan,
      "r2_bar": float(s.sum_row_max_cos) / num_tokens if num_tokens else nan,
      "residual_share": (float(s.sum_sq_residual) / float(s.sum_sq_z)
                         if float(s.sum_sq_z) > 0 else nan),
      "dead": dead,
      "dead_frac": dead / len(usage),
      "num_tokens": num_tokens,
      "usage": usage,
  }


_update_jit = jax.jit(grounding_update)


class GroundingAccumulator:
  """Stateful convenience around the pure functions (one jitted update per batch shape)."""

  def __init__(self, num_prototypes: int):
    self.state = grounding_init(num_prototypes)

  def update(self, protos: PrototypeOutput, z_NxD: jax.Array,
             mask_N: jax.Array | None = None) -> None:
    if mask_N is None:
      mask_N = jnp.ones(z_NxD.shape[0], bool)
    self.state = _update_jit(self.state, protos, z_NxD, mask_N)

  def update_from_output(self, out: Any, mask_BxT: jax.Array | None = None) -> None:
    """Adds a PrismLM output (`LMOutput`, computed with the same `mask_BxT`)."""
    if out.protos is None:
      raise ValueError("grounding metrics need a PrismLM output; the dense model has no bank")
    z_NxD = out.z_BxTxD.reshape(-1, out.z_BxTxD.shape[-1])
    self.update(out.protos, z_NxD, None if mask_BxT is None else mask_BxT.reshape(-1))

  def merge(self, other: "GroundingAccumulator") -> "GroundingAccumulator":
    self.state = grounding_merge(self.state, other.state)
    return self

  def result(self) -> dict[str, Any]:
    return grounding_finalize(self.state)


# A bank set from hidden states that all point one way collapses under cosine routing: the
# few prototypes nearest the shared direction win every token (the `small` rehearsal set its
# bank at step 6 of a cut run: mean cosine 0.98-0.99, 3% of the bank ever selected; set at
# step 200, cosine 0.45, 98% selected; docs/RESULTS.md "A bank that stays alive").
SHARED_DIRECTION_WARN = 0.9


def common_direction_cos(z_NxD: np.ndarray) -> float:
  """Mean cosine of the states to their mean direction (1: all parallel, ~0: spread)."""
  z = np.asarray(z_NxD, np.float64)
  unit = z / np.maximum(np.linalg.norm(z, axis=-1, keepdims=True), 1e-30)
  mean = unit.mean(0)
  return float((unit @ (mean / max(np.linalg.norm(mean), 1e-30))).mean())


def shared_direction_warning(cos: float) -> str:
  """'' or one line warning that a bank set from these states may collapse."""
  if cos <= SHARED_DIRECTION_WARN:
    return ""
  return (f"the hidden states share one direction (mean cosine {cos:.2f} to their mean): a "
          "bank set from them may collapse onto a few prototypes; set the bank later "
          "(train.proto_init_step) or revive unused ones (train.revive_every)")

