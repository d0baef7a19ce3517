"""Hessian of the training loss w.r.t. the prototype bank, its blocks, and the §4 model.

Small K·D only (tests, notebooks, the λ sweep): everything here forms (K·D)×(K·D) matrices.
Run under `with jax.enable_x64(True):` for float64 (the default dtype follows that flag).
The streaming factors for real banks live in curvature_stats (re-exported here), the head
as a pure function of P and the derivation of g_t, G_t and μ_i in curvature.

What is exact and what is approximate (vec(P) row-major; N valid tokens; path="linear"
holds the activations a_t fixed, see curvature's module docstring):
  exact_hessian_wrt_bank(path="linear", terms="output")
      = exact_ggn_wrt_bank(path="linear")            (ẑ is linear in P: GGN = Hessian)
      = per_token_gn_blocks = (1/N) Σ_t (a_t a_tᵀ) ⊗ G_t       (exact, per token)
  exact_hessian_wrt_bank(path="linear", terms="clustering") = blockdiag(C_i)  (exact);
      C_i = μ_i I exactly for sqeuclidean, trace-matched μ_i for cosine.
  A ⊗ G + blockdiag(μ_i I) (curvature_stats.ggn_blocks) is the K-FAC approximation: it
      replaces (1/N) Σ_t a a ⊗ G_t by E[a aᵀ] ⊗ E[G_t]; `curvature_report` measures its error.
  exact_hessian_wrt_bank(path="full") adds the similarity-routing path a_t(P): the Hessian
      `jax.hessian` sees for the actual training loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.hessians import curvature_stats as cs
from prism_jax.attribution.hessians.curvature import (HeadInputs, OutputGrads,  # noqa: F401
                                             bank_loss, head_inputs, output_grads)
from prism_jax.attribution.hessians.curvature_stats import (  # noqa: F401
    CurvatureAccumulator, CurvatureStats, GGNBlocks, block_matrix, block_norms, block_view,
    condition_number, curvature_stats, eig_G, ggn_blocks, kappa_bound, kfac_block_norms,
    kfac_matrix, off_block_share)
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.losses import token_nll, token_rec, total_loss

METHODS = ("hvp", "jax_hessian")


def _default_dtype(dtype):
  if dtype is not None:
    return dtype
  return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def head_and_spec(model, batch, dtype=None):
  """(HeadInputs in dtype — float64 under jax.enable_x64 by default —, ModelConfig)."""
  return cv.head_inputs(model, batch, _default_dtype(dtype)), cv.check_model(model)


def library_bank_loss(model: Any, batch: dict[str, Any], loss_cfg: LossConfig):
  """The training loss as prism_jax computes it (PrismLM forward + losses.total_loss, fp32)
  as a function of P: the reference that `bank_loss` is checked against. The prototype
  layer runs its pure-JAX ("xla") implementation: kernels' custom_vjp has no forward mode,
  which jax.hessian needs."""
  gdef, p_state, rest = nnx.split(model, lambda path, _: path[-1] == "protos", ...)
  inputs = jnp.asarray(batch["inputs"], jnp.int32)
  targets = jnp.asarray(batch["targets"], jnp.int32)
  mask = jnp.asarray(batch["mask"], bool)

  def loss_fn(protos_KxD):
    m = nnx.merge(gdef, jax.tree.map(lambda _: protos_KxD, p_state), rest)
    m.bank.implementation = "xla"
    return total_loss(m(inputs, mask_BxT=mask), targets, mask, loss_cfg)[0]
  return loss_fn


def hessian_from_head(head: HeadInputs, spec: ModelConfig, loss_cfg: LossConfig, *,
                      path: str = "full", terms: str = "all", method: str = "hvp") -> np.ndarray:
  """(K·D)×(K·D) Hessian of `bank_loss` at head.protos_KxD."""
  if method not in METHODS:
    raise ValueError(f"method={method!r}; use one of {METHODS}")
  num_k, d = head.protos_KxD.shape
  f = lambda v: cv.bank_loss(v.reshape(num_k, d), head, spec, loss_cfg, path=path, terms=terms)
  p0 = head.protos_KxD.reshape(-1)
  if method == "jax_hessian":
    h = jax.jit(jax.hessian(f))(p0)
  else:  # forward-over-reverse Hessian-vector products against the basis vectors
    hvp = lambda e: jax.jvp(jax.grad(f), (p0,), (e,))[1]
    h = jax.jit(jax.vmap(hvp))(jnp.eye(p0.size, dtype=p0.dtype)).T
  return np.asarray(h)


def exact_hessian_wrt_bank(model: Any, batch: dict[str, Any], loss_cfg: LossConfig, *,
                           path: str = "full", terms: str = "all", method: str = "hvp",
                           dtype: Any = None) -> np.ndarray:
  """Exact Hessian of the training loss w.r.t. vec(P), (K·D)×(K·D); `block_view` gives the
  K×K grid of D×D blocks. path/terms: see curvature.bank_loss."""
  head, spec = head_and_spec(model, batch, dtype)
  return hessian_from_head(head, spec, loss_cfg, path=path, terms=terms, method=method)


def ggn_from_head(head: HeadInputs, spec: ModelConfig, loss_cfg: LossConfig, *,
                  path: str = "linear") -> np.ndarray:
  """Jᵀ H_out J by autodiff: J = ∂(logits, residual)/∂vec(P), H_out the per-token Hessian of
  the mean CE w.r.t. the logits (jax.hessian of log-softmax CE) and of λ_rec REC w.r.t. r."""
  num_k, d = head.protos_KxD.shape
  p0 = head.protos_KxD.reshape(-1)

  def outputs(v):
    out = cv.head_forward(v.reshape(num_k, d), head, spec, path=path)
    return out.logits, out.protos.residual_NxD
  j_logits, j_res = jax.jacfwd(outputs)(p0)  # (N, V, KD), (N, D, KD)
  m = head.mask_N.astype(p0.dtype)
  n_valid = jnp.maximum(jnp.sum(m), 1.0)
  ce = lambda logit_V, y: token_nll(logit_V[None], y[None])[0]
  out0 = cv.head_forward(head.protos_KxD, head, spec, path=path)
  h_ce = jax.vmap(jax.hessian(ce), (0, 0))(out0.logits, head.targets_N)  # (N, V, V)
  h_ce = h_ce * (m / n_valid)[:, None, None]
  rec = lambda r_D, z_D: token_rec(z_D[None], r_D[None], loss_cfg.rec_kind)[0]
  h_rec = jax.vmap(jax.hessian(rec), (0, 0))(out0.protos.residual_NxD, head.z_NxD)  # (N, D, D)
  h_rec = h_rec * (loss_cfg.lambda_rec * m / n_valid)[:, None, None]
  hi = jax.lax.Precision.HIGHEST
  ggn = jnp.einsum("nvp,nvw,nwq->pq", j_logits, h_ce, j_logits, precision=hi)
  ggn = ggn + jnp.einsum("nap,nab,nbq->pq", j_res, h_rec, j_res, precision=hi)
  return np.asarray(ggn)


def exact_ggn_wrt_bank(model: Any, batch: dict[str, Any], loss_cfg: LossConfig, *,
                       path: str = "linear", dtype: Any = None) -> np.ndarray:
  """Generalised Gauss-Newton of the ẑ-terms (CE + λ_rec REC) w.r.t. vec(P) by autodiff."""
  head, spec = head_and_spec(model, batch, dtype)
  return ggn_from_head(head, spec, loss_cfg, path=path)


def dense_activations(og: OutputGrads, num_k: int) -> np.ndarray:
  act = np.asarray(og.act_Nxk, np.float64)
  dense = np.zeros((act.shape[0], num_k))
  np.put_along_axis(dense, np.asarray(og.idx_Nxk), act, axis=1)
  return dense


def gn_blocks_from_head(head: HeadInputs, spec: ModelConfig, loss_cfg: LossConfig) -> np.ndarray:
  """(1/N) Σ_t (a_t a_tᵀ) ⊗ G_t as (K, K, D, D) blocks, from a_t and the analytic G_t."""
  og = cv.output_grads_from_head(head, spec, loss_cfg)
  a_NxK = dense_activations(og, head.protos_KxD.shape[0])
  g_NxDxD = np.asarray(cv.per_token_G(head, spec, loss_cfg), np.float64)
  n_valid = max(float(np.sum(np.asarray(og.mask_N))), 1.0)
  return np.einsum("ni,nj,nab->ijab", a_NxK, a_NxK, g_NxDxD) / n_valid


def per_token_gn_blocks(model: Any, batch: dict[str, Any], loss_cfg: LossConfig, *,
                        dtype: Any = None) -> np.ndarray:
  """Exact linear-path Gauss-Newton blocks (1/N) Σ_t (a_t a_tᵀ) ⊗ G_t, (K, K, D, D)."""
  head, spec = head_and_spec(model, batch, dtype)
  return gn_blocks_from_head(head, spec, loss_cfg)


def clustering_blocks_from_head(head: HeadInputs, spec: ModelConfig,
                                loss_cfg: LossConfig) -> np.ndarray:
  """Exact Hessian of λ_1 R1 + λ_2 R2 as (K, K, D, D) blocks (block-diagonal)."""
  _, c_KxDxD = cv.clustering_curvature(head, spec, loss_cfg, blocks=True)
  num_k, d = head.protos_KxD.shape
  out = np.zeros((num_k, num_k, d, d))
  out[np.arange(num_k), np.arange(num_k)] = np.asarray(c_KxDxD, np.float64)
  return out


def stats_from_head(head: HeadInputs, spec: ModelConfig, loss_cfg: LossConfig,
                    fisher: str = "true") -> CurvatureStats:
  acc = cs.CurvatureAccumulator(*head.protos_KxD.shape, loss_cfg, fisher=fisher)
  acc.update_from_head(head, spec)
  return acc.finalize()


@dataclasses.dataclass(frozen=True)
class CurvatureReport:
  """Localisation and conditioning of the bank's curvature on one batch."""

  off_block_full: float  # off-block share of the exact Hessian (similarity path included)
  off_block_linear: float  # ... of the exact linear-path Hessian (GN + clustering)
  off_block_gn: float  # ... of its Gauss-Newton part alone (1/N) Σ a aᵀ ⊗ G_t (no λ terms)
  off_block_kfac: float  # ... of the §4 model A ⊗ G + blockdiag(μ I)
  kappa_full: float  # 2-norm condition numbers (inf when singular)
  kappa_linear: float
  kappa_kfac: float
  kappa_bound: float  # (λmax(A) λmax(G) + μmax) / μmin, bounds kappa_kfac
  kfac_rel_error: float  # ‖A ⊗ G − (1/N) Σ a aᵀ ⊗ G_t‖_F / ‖(1/N) Σ a aᵀ ⊗ G_t‖_F
  linear_vs_full_rel: float  # ‖H_linear − H_full‖_F / ‖H_full‖_F
  mu_min: float
  mu_max: float
  dead_prototypes: int  # A_ii = 0 on this batch
  num_tokens: int

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def curvature_report(model: Any, batch: dict[str, Any], loss_cfg: LossConfig, *,
                     dtype: Any = None, rtol: float = 1e-12) -> CurvatureReport:
  """All §4 numbers for one batch (small K·D; prefer float64 via jax.enable_x64)."""
  head, spec = head_and_spec(model, batch, dtype)
  num_k = head.protos_KxD.shape[0]
  h_full = hessian_from_head(head, spec, loss_cfg, path="full")
  gn = gn_blocks_from_head(head, spec, loss_cfg)
  h_lin = block_matrix(gn + clustering_blocks_from_head(head, spec, loss_cfg))
  stats = stats_from_head(head, spec, loss_cfg)
  kfac = ggn_blocks(stats)
  kfac_out = np.einsum("ij,ab->ijab", stats.a_dense(), stats.G)
  share = lambda h: off_block_share(block_norms(block_view(h, num_k)))
  rel = lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300))
  return CurvatureReport(
      off_block_full=share(h_full), off_block_linear=share(h_lin),
      off_block_gn=off_block_share(block_norms(gn)),
      off_block_kfac=off_block_share(block_norms(kfac.full)),
      kappa_full=condition_number(h_full, rtol), kappa_linear=condition_number(h_lin, rtol),
      kappa_kfac=condition_number(block_matrix(kfac.full), rtol),
      kappa_bound=kappa_bound(stats), kfac_rel_error=rel(kfac_out, gn),
      linear_vs_full_rel=rel(h_lin, h_full), mu_min=float(stats.mu.min()),
      mu_max=float(stats.mu.max()), dead_prototypes=int(np.sum(stats.a_diag() == 0)),
      num_tokens=int(stats.count))
