"""TRAK (Park et al. 2023), the cheap whole-model baseline beside EK-FAC: per-sequence
gradients over every parameter, randomly projected to R dimensions, then a kernel
regression preconditioner in the projected space:

    φ_t = Pᵀ g_t   (P: P x R Gaussian, N(0, 1/R), seeded)
    score(q, t) = φ_qᵀ (ΦᵀΦ + λ I)⁻¹ φ_t        Φ: the E training rows' φ, (E, R)
    λ = damping · tr(ΦᵀΦ) / R

averaged over an ensemble of M independent projections. g is the gradient of the summed
token CE over a sequence's loss tokens (the query's targets, a training row's mask), the
output function every method here scores (grad_dot.py); TRAK's (1 − p) reweighting of
the training gradients and its ensemble over independently trained models are not used:
with one trained model the ensemble is over projections only (say so beside its numbers).
**Sign: positive = the training sequence helps the query**, as for every method.

The training gradients are projected in the same jitted pass that computes them (one pass
over the rows for all M members: the projections stacked, (P, M·R)).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.attribution.caching import cache_format
from prism_jax.attribution.scoring import grad_dot
from prism_jax.data import batch as batch_lib


@dataclasses.dataclass(frozen=True)
class TrakConfig:
  proj_dim: int = 256  # R
  ensemble: int = 4  # M independent projections
  damping: float = 1e-3  # λ relative to the mean eigenvalue of ΦᵀΦ
  seed: int = 0

  def __post_init__(self):
    if self.proj_dim < 1 or self.ensemble < 1 or not self.damping > 0:
      raise ValueError(f"TrakConfig needs proj_dim >= 1, ensemble >= 1 and damping > 0, got "
                       f"{self.proj_dim}, {self.ensemble}, {self.damping}")


def projections(cfg: TrakConfig, num_params: int) -> jax.Array:
  """(P, M·R) float32: the M projections side by side, member m = columns m·R..(m+1)·R."""
  key = jax.random.key(cfg.seed)
  return jnp.concatenate([
      jax.random.normal(jax.random.fold_in(key, m), (num_params, cfg.proj_dim), jnp.float32)
      / np.sqrt(cfg.proj_dim) for m in range(cfg.ensemble)], axis=1)


@functools.partial(jax.jit, static_argnums=0)
def _projected(graphdef, params, rest, proj_PxMR, inputs_BxT, targets_BxT, mask_BxT):
  g_BxP = grad_dot.flat_grads(graphdef, params, rest, inputs_BxT, targets_BxT, mask_BxT)
  return jnp.matmul(g_BxP, proj_PxMR, precision=jax.lax.Precision.HIGHEST)


def kernel_scores(phi_q_QxR: np.ndarray, phi_ExR: np.ndarray, damping: float) -> np.ndarray:
  """φ_qᵀ (ΦᵀΦ + λ I)⁻¹ Φᵀ in float64, (Q, E), one ensemble member."""
  phi_q, phi = np.asarray(phi_q_QxR, np.float64), np.asarray(phi_ExR, np.float64)
  gram = phi.T @ phi
  lam = damping * np.trace(gram) / len(gram)
  return np.linalg.solve(gram + lam * np.eye(len(gram)), phi_q.T).T @ phi.T


@dataclasses.dataclass(frozen=True)
class TrakRows:
  """What TRAK keeps to score queries: the rows' ids (E,), their projected gradients Φ
  (E, M·R: the M members side by side) and the projections themselves (P, M·R)."""

  ids_E: np.ndarray
  phi_ExMR: np.ndarray
  proj_PxMR: jax.Array
  cfg: TrakConfig


def trak_rows(model, packed, *, split: str = "train", max_rows: int | None = None,
              cfg: TrakConfig = TrakConfig(), batch_rows: int = 16) -> TrakRows:
  """Every training row's projected gradient (the first `max_rows` rows of `split`)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  proj = projections(cfg, sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))
  ids, parts = [], []
  for start, batch in cache_format.iter_rows(packed, split, batch_rows, 0, max_rows):
    n = len(batch["inputs"])
    phi = _projected(graphdef, params, rest, proj,
                     *grad_dot.device_batch(batch_lib.pad_batch(batch, batch_rows)))
    parts.append(np.asarray(phi)[:n])
    ids.append(np.arange(start, start + n))
  if not ids:
    raise ValueError(f"split {split!r} has no rows to score")
  return TrakRows(np.concatenate(ids), np.concatenate(parts), proj, cfg)


def trak_query_scores(model, query: dict[str, np.ndarray], rows: TrakRows, *,
                      batch_rows: int = 16) -> np.ndarray:
  """(Q, E): every query row of the batch `query` scored against `rows` (trak_rows: its
  projections, damping and ensemble), the ensemble's mean."""
  cfg = rows.cfg
  q_QxP = grad_dot.query_gradients(model, query, batch_rows)
  phi_q = np.asarray(jnp.matmul(q_QxP, rows.proj_PxMR, precision=jax.lax.Precision.HIGHEST))
  r, phi = cfg.proj_dim, rows.phi_ExMR
  return np.mean([kernel_scores(phi_q[:, m * r:(m + 1) * r], phi[:, m * r:(m + 1) * r],
                                cfg.damping) for m in range(cfg.ensemble)], axis=0)


def trak_scores(model, query: dict[str, np.ndarray], packed, *, split: str = "train",
                max_rows: int | None = None, cfg: TrakConfig = TrakConfig(),
                batch_rows: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """(ids_E, scores_QxE): TRAK's score of every training row (the first `max_rows` rows of
  `split`) for every query row of the batch `query`, the ensemble's mean."""
  rows = trak_rows(model, packed, split=split, max_rows=max_rows, cfg=cfg,
                   batch_rows=batch_rows)
  return rows.ids_E, trak_query_scores(model, query, rows, batch_rows=batch_rows)
