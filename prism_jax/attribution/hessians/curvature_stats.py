"""Streaming Gauss-Newton factors of the prototype bank and the §4 block model.

    H_P ≈ A ⊗ G + blockdiag(μ_1 I_D, …, μ_K I_D)                       (PRISM.md §4)
    A = E_t[a_t a_tᵀ]  (K×K co-usage)      G = E_t[G_t]  (D×D)      μ_i: clustering

E_t is the mean over valid tokens (mask True), so for one batch A ⊗ G is the K-FAC
(Kronecker-of-expectations) approximation of the exact linear-path Gauss-Newton matrix
(1/N) Σ_t (a_t a_tᵀ) ⊗ G_t (see prism_jax.attribution.hessians.curvature). G_t is the token's true
Fisher (fisher="true", default: the exact expectation over y ~ softmax, no sampling) or the
empirical g_t g_tᵀ with the observed target (fisher="empirical"). μ is averaged per batch
(the training loss is a per-batch mean and R1 takes a batch-wide minimum); A and G per token.

Layout: vec(P) is row-major (p_i contiguous), so block (i, j) of a (K·D)×(K·D) matrix is
rows i*D:(i+1)*D, columns j*D:(j+1)*D, and A ⊗ G is np.kron(A, G).
Storage of A: dense float64 for K ≤ `dense_max` (default 4096: 128 MiB), else a
scipy.sparse CSR matrix (co-usage is very sparse: at most k² entries per token).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse
import scipy.sparse.linalg

from prism_jax.attribution.hessians import curvature as cv
from prism_jax.config import LossConfig, ModelConfig

FISHERS = ("true", "empirical")


class CurvatureStats(NamedTuple):
  A: Any  # (K, K) float64 ndarray, or scipy.sparse CSR when K > dense_max
  G: np.ndarray  # (D, D) float64
  mu: np.ndarray  # (K,) float64 local clustering curvature
  count: int  # valid tokens seen
  num_batches: int = 0
  fisher: str = "true"

  def a_diag(self) -> np.ndarray:
    return np.asarray(self.A.diagonal(), np.float64)

  def a_dense(self) -> np.ndarray:
    return self.A.toarray() if scipy.sparse.issparse(self.A) else np.asarray(self.A)


@functools.partial(jax.jit, static_argnames=("model_cfg", "loss_cfg", "fisher"))
def batch_curvature(head: cv.HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig,
                    fisher: str = "true"):
  """One batch: (OutputGrads, Σ_t G_t (D×D), μ (K,), number of valid tokens)."""
  og, out = cv.output_grads_and_head(head, model_cfg, loss_cfg)
  if fisher == "true":
    g_sum = cv.output_hessian_sum(head, model_cfg, loss_cfg, out.logits)
  else:
    g_sum = jnp.dot(og.g_NxD.T, og.g_NxD, precision=jax.lax.Precision.HIGHEST)
  mu_K = cv.clustering_curvature(head, model_cfg, loss_cfg, layer=out.protos)
  return og, g_sum, mu_K, jnp.sum(og.mask_N)


def batch_output_grads(model: Any, batch: dict[str, Any], loss_cfg: LossConfig,
                       fisher: str = "true") -> cv.OutputGrads:
  """The OutputGrads `CurvatureAccumulator.update` returns for `batch`, from the same
  program (the same bits), without accumulating."""
  return batch_curvature(cv.head_inputs(model, batch), cv.check_model(model), loss_cfg,
                         fisher)[0]


class CurvatureAccumulator:
  """Streams batches into (Σ a aᵀ, Σ G_t, Σ_batches μ, counts); `finalize` gives means.

  acc = CurvatureAccumulator(K, D, loss_cfg); og = acc.update(model, batch); ...
  stats = acc.finalize(). `update` returns the batch's OutputGrads so a caller that also
  needs per-token records runs the model once. Accumulation is float64 on the host.
  """

  def __init__(self, num_prototypes: int, d_model: int, loss_cfg: LossConfig, *,
               fisher: str = "true", dense_max: int = 4096):
    if fisher not in FISHERS:
      raise ValueError(f"fisher={fisher!r}; use one of {FISHERS}")
    if num_prototypes <= 0 or d_model <= 0:
      raise ValueError(f"num_prototypes and d_model must be positive, got "
                       f"{num_prototypes}, {d_model}")
    self.num_prototypes, self.d_model = int(num_prototypes), int(d_model)
    self.loss_cfg, self.fisher = loss_cfg, fisher
    self.sparse = self.num_prototypes > dense_max
    k = self.num_prototypes
    self.a_sum = (scipy.sparse.csr_matrix((k, k)) if self.sparse else np.zeros((k, k)))
    self.g_sum = np.zeros((self.d_model, self.d_model))
    self.mu_sum = np.zeros(k)
    self.count = 0
    self.num_batches = 0

  def update(self, model: Any, batch: dict[str, Any]) -> cv.OutputGrads:
    head = cv.head_inputs(model, batch)
    return self.update_from_head(head, cv.check_model(model))

  def update_from_head(self, head: cv.HeadInputs, model_cfg: ModelConfig) -> cv.OutputGrads:
    if head.protos_KxD.shape != (self.num_prototypes, self.d_model):
      raise ValueError(f"bank shape {head.protos_KxD.shape} does not match the accumulator's "
                       f"(K, D)=({self.num_prototypes}, {self.d_model})")
    og, g_sum, mu_K, count = batch_curvature(head, model_cfg, self.loss_cfg, self.fisher)
    self.add(og.idx_Nxk, og.act_Nxk, g_sum, mu_K, int(count))
    return og

  def add(self, idx_Nxk, act_Nxk, g_sum_DxD, mu_K, count: int) -> None:
    """Adds raw sums (masked activations must already be zero). A batch without valid
    tokens (all padding) is skipped, so it does not dilute the per-batch mean of μ."""
    if int(count) == 0:
      return
    idx = np.asarray(idx_Nxk, np.int64)
    act = np.asarray(act_Nxk, np.float64)
    rows = np.repeat(idx, idx.shape[1], axis=1).ravel()
    cols = np.tile(idx, (1, idx.shape[1])).ravel()
    vals = (act[:, :, None] * act[:, None, :]).ravel()
    k = self.num_prototypes
    if self.sparse:
      self.a_sum = self.a_sum + scipy.sparse.coo_matrix((vals, (rows, cols)),
                                                        shape=(k, k)).tocsr()
    else:
      self.a_sum += np.bincount(rows * k + cols, weights=vals, minlength=k * k).reshape(k, k)
    self.g_sum += np.asarray(g_sum_DxD, np.float64)
    self.mu_sum += np.asarray(mu_K, np.float64)
    self.count += int(count)
    self.num_batches += 1

  def merge(self, other: "CurvatureAccumulator") -> "CurvatureAccumulator":
    """Adds another accumulator's sums into this one (e.g. from another host or shard)."""
    if (other.num_prototypes, other.d_model, other.fisher, other.loss_cfg) != \
       (self.num_prototypes, self.d_model, self.fisher, self.loss_cfg):
      raise ValueError("cannot merge accumulators with different K, D, fisher or loss config")
    self.a_sum = self.a_sum + other.a_sum
    self.g_sum += other.g_sum
    self.mu_sum += other.mu_sum
    self.count += other.count
    self.num_batches += other.num_batches
    return self

  def state(self) -> dict[str, Any]:
    """Plain arrays, for checkpointing a partial pass (see `from_state`)."""
    a = self.a_sum.tocoo() if self.sparse else None
    return {"a_sum": self.a_sum if not self.sparse else None,
            "a_rows": None if a is None else a.row, "a_cols": None if a is None else a.col,
            "a_vals": None if a is None else a.data, "g_sum": self.g_sum,
            "mu_sum": self.mu_sum, "count": self.count, "num_batches": self.num_batches}

  def load_state(self, state: dict[str, Any]) -> "CurvatureAccumulator":
    k = self.num_prototypes
    if self.sparse:
      self.a_sum = scipy.sparse.coo_matrix(
          (state["a_vals"], (state["a_rows"], state["a_cols"])), shape=(k, k)).tocsr()
    else:
      self.a_sum = np.array(state["a_sum"], np.float64).reshape(k, k)
    self.g_sum = np.array(state["g_sum"], np.float64)
    self.mu_sum = np.array(state["mu_sum"], np.float64)
    self.count, self.num_batches = int(state["count"]), int(state["num_batches"])
    return self

  def finalize(self) -> CurvatureStats:
    if self.count == 0 or self.num_batches == 0:
      raise ValueError("no valid tokens were accumulated: call update() with batches whose "
                       "mask has True entries before finalize()")
    a = self.a_sum / self.count
    if self.sparse:
      a = scipy.sparse.csr_matrix(a)
    g = self.g_sum / self.count
    return CurvatureStats(a, 0.5 * (g + g.T), self.mu_sum / self.num_batches,
                          self.count, self.num_batches, self.fisher)


def curvature_stats(model: Any, batches, loss_cfg: LossConfig, *,
                    fisher: str = "true") -> CurvatureStats:
  """One pass of `CurvatureAccumulator` over an iterable of batch dicts."""
  acc = CurvatureAccumulator(model.cfg.num_prototypes, model.cfg.d_model, loss_cfg,
                             fisher=fisher)
  for batch in batches:
    acc.update(model, batch)
  return acc.finalize()


def eig_G(stats: CurvatureStats, rank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Top `rank` eigenpairs of G, descending: (evals_r, evecs_Dxr); rank=None gives all D."""
  d = stats.G.shape[0]
  rank = d if rank is None else int(rank)
  if not 1 <= rank <= d:
    raise ValueError(f"rank must be in [1, D={d}], got {rank}")
  evals, evecs = np.linalg.eigh(0.5 * (stats.G + stats.G.T))
  order = np.argsort(evals)[::-1][:rank]
  return evals[order], evecs[:, order]


class GGNBlocks(NamedTuple):
  """K×K grid of D×D blocks of the §4 model, split as PRISM.md §4 does."""

  local: np.ndarray  # (K, K, D, D): diag(A) ⊗ G + blockdiag(μ_i I); zero off the diagonal
  coupling: np.ndarray  # (K, K, D, D): (A − diag A) ⊗ G; zero on the diagonal

  @property
  def full(self) -> np.ndarray:
    return self.local + self.coupling


def ggn_blocks(stats: CurvatureStats, max_elements: int = 1 << 26) -> GGNBlocks:
  """Dense blocks of A ⊗ G + blockdiag(μ I) (small K·D only; see `kfac_block_norms`)."""
  a = stats.a_dense()
  k, d = a.shape[0], stats.G.shape[0]
  if (k * d) ** 2 > max_elements:
    raise ValueError(f"(K·D)² = {(k * d) ** 2} elements exceed max_elements={max_elements}; "
                     "use kfac_block_norms / kfac_off_block_share for large banks")
  full = np.einsum("ij,ab->ijab", a, stats.G)
  eye = np.eye(d)
  local = np.zeros_like(full)
  diag = np.arange(k)
  local[diag, diag] = full[diag, diag] + stats.mu[:, None, None] * eye
  full[diag, diag] = 0.0
  return GGNBlocks(local, full)


def kfac_matrix(stats: CurvatureStats) -> np.ndarray:
  """(K·D)×(K·D) matrix A ⊗ G + blockdiag(μ_i I) (small sizes)."""
  return block_matrix(ggn_blocks(stats).full)


def kfac_block_norms(stats: CurvatureStats) -> np.ndarray:
  """Frobenius norm of every block of the §4 model, (K, K), without forming blocks:
  ‖A_ij G‖ = |A_ij| ‖G‖ off the diagonal, ‖A_ii G + μ_i I‖² = A_ii²‖G‖² + 2A_ii μ_i tr G
  + D μ_i² on it."""
  a = stats.a_dense()
  gf2 = float(np.sum(stats.G ** 2))
  norms2 = a ** 2 * gf2
  ad = np.diag(a)
  d = stats.G.shape[0]
  np.fill_diagonal(norms2, ad ** 2 * gf2 + 2 * ad * stats.mu * np.trace(stats.G)
                   + d * stats.mu ** 2)
  return np.sqrt(np.maximum(norms2, 0.0))


def block_view(h: np.ndarray, num_prototypes: int) -> np.ndarray:
  """(K·D)×(K·D) -> (K, K, D, D) blocks (vec(P) row-major)."""
  h = np.asarray(h)
  kd = h.shape[0]
  if h.ndim != 2 or h.shape != (kd, kd) or kd % num_prototypes:
    raise ValueError(f"expected a square (K·D)×(K·D) matrix with K={num_prototypes}, "
                     f"got shape {h.shape}")
  d = kd // num_prototypes
  return h.reshape(num_prototypes, d, num_prototypes, d).transpose(0, 2, 1, 3)


def block_matrix(blocks: np.ndarray) -> np.ndarray:
  """(K, K, D, D) blocks -> (K·D)×(K·D)."""
  k, _, d, _ = blocks.shape
  return np.asarray(blocks).transpose(0, 2, 1, 3).reshape(k * d, k * d)


def block_norms(blocks: np.ndarray) -> np.ndarray:
  """Frobenius norm of each D×D block, (K, K)."""
  return np.sqrt(np.sum(np.square(blocks), axis=(2, 3)))


def off_block_share(norms_KxK: np.ndarray) -> float:
  """Squared-Frobenius mass of the off-diagonal blocks / total (0 = block-diagonal)."""
  n2 = np.square(np.asarray(norms_KxK, np.float64))
  total = float(n2.sum())
  return float((total - np.trace(n2)) / total) if total > 0 else 0.0


def condition_number(h: np.ndarray, rtol: float = 1e-12) -> float:
  """2-norm condition number max|λ|/min|λ| of a symmetric matrix; inf when singular
  (min|λ| ≤ rtol·max|λ|)."""
  ev = np.abs(np.linalg.eigvalsh(0.5 * (h + h.T)))
  lo, hi = float(ev.min()), float(ev.max())
  return float("inf") if hi == 0 or lo <= rtol * hi else hi / lo


def kappa_bound(stats: CurvatureStats) -> float:
  """§4 bound κ(A ⊗ G + blockdiag μI) ≤ (λ_max(A) λ_max(G) + μ_max) / μ_min (inf if
  μ_min ≤ 0). Holds because A ⊗ G ⪰ 0 with λ_max = λ_max(A) λ_max(G)."""
  a = stats.A
  if scipy.sparse.issparse(a) and a.shape[0] > 2048:
    lam_a = float(scipy.sparse.linalg.eigsh(a, k=1, which="LA", return_eigenvectors=False)[0])
  else:
    lam_a = float(np.linalg.eigvalsh(stats.a_dense())[-1])
  lam_g = float(np.linalg.eigvalsh(0.5 * (stats.G + stats.G.T))[-1])
  mu_min, mu_max = float(stats.mu.min()), float(stats.mu.max())
  if mu_min <= 0:
    return float("inf")
  return (lam_a * lam_g + mu_max) / mu_min
