"""The training loss as a function of the prototype bank P, and its output-side curvature.

Everything here treats the backbone as fixed: z_t (final hidden state), W (tied LM head) and
the targets are constants, and the training loss is a function of P alone (PRISM.md §2):

    L(P) = CE + λ_rec REC + λ_1 R1 + λ_2 R2        (the same terms as prism_jax.losses)

The functions are dtype-generic (run them under `jax.enable_x64(True)` with float64 inputs
for reference-grade Hessians). The head is the model's own (prism_jax.model.head.prism_head,
every option of ModelConfig: mixture, learned mixture scale, distance, routing) with P as an
argument; the loss terms are prism_jax.losses' (token_nll, token_rec, r1/r2_clustering).
The attributed loss is PRISM.md §2's four terms: the training levers that read W ẑ
(loss.lambda_proto, lambda_rlogit, lambda_proto_kl) are not part of it; `bank_loss`, which
claims to be the training loss, refuses a config that sets them.

Which path of ∂L/∂P we differentiate (PRISM.md §4 "the bank as a linear layer"):
  ẑ_t = Σ_{i∈S_t} a_{t,i} p_i = Pᵀ a_t, and P reaches the loss through ẑ_t in two ways:
  * path="linear": through the explicit p_i only, with the activations a_t held fixed
    (stop_gradient on a; with a learned mixture scale s, a_t is the scaled s a_t). This is
    the linear-layer view of §4: ∂L_t/∂P = a_t g_tᵀ, and the exact Hessian of the ẑ-terms
    on this path is the Gauss-Newton matrix
        H_lin = (1/N) Σ_t (a_t a_tᵀ) ⊗ G_t,     G_t = ∂²ℓ_t/∂ẑ_t²,
    because ẑ is linear in P and the logits are linear in ẑ (no second-order term).
  * path="full": also through a_t(P) = ReLU(cos(z_t, p_i)) (the similarity routing). This
    is what `jax.hessian` of the actual training loss sees; §4's Kronecker model ignores it.
  The top-k index set and the argmins in R1/R2 are piecewise constant in P, so both paths
  are exact Hessians of the loss (almost everywhere; ties are measure-zero).
  Under the default straight-through routing, logits = W(z − sg(ẑ) + ẑ): CE reaches P only
  through ẑ (its value equals W z), and REC (r = z − sg(ẑ)) does not reach P at all. Under
  "plain" routing CE never reaches P and REC does. `jax.hessian` of a function containing
  stop_gradient is the Hessian with the stopped values frozen at the evaluation point: that
  is the curvature the straight-through optimiser follows, and the one we compute.

Per-token output gradient g_t = ∂ℓ_t/∂ẑ_t of the token's own loss ℓ_t = CE_t + λ_rec REC_t
(not divided by N): under straight-through g_t = Wᵀ(π_t − e_{y_t}) and
G_t = Wᵀ(diag π_t − π_t π_tᵀ)W = E_{y~π_t}[g_t(y) g_t(y)ᵀ] (the true Fisher of the token);
under plain routing g_t = −2 λ_rec r_t/‖z_t‖² and G_t = 2 λ_rec/‖z_t‖² I (relative REC).
The batch loss is a mean over the N valid tokens, so ∇_P L = (1/N) Σ_t a_t g_tᵀ.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax import losses
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.model.head import HeadOutput, prism_head
from prism_jax.model.prototypes import EPS, PrototypeOutput, first_extremum, inv_norm, similarity
from prism_jax.model.tap import Tap

_HI = jax.lax.Precision.HIGHEST
Path = Literal["linear", "full"]
# The weighted terms of L(P) each `terms` selects (see bank_loss).
TERMS = {"all": ("ce", "rec", "r1", "r2"), "output": ("ce", "rec"), "clustering": ("r1", "r2")}


def check_model(model: Any) -> ModelConfig:
  """The model's ModelConfig; a clear error for a model without a prototype head."""
  cfg = model.cfg
  if cfg.kind != "prism":
    raise ValueError("curvature w.r.t. the prototype bank needs a PrismLM (model.kind="
                     f"'prism'), got kind={cfg.kind!r}")
  return cfg


def _norm_inv(x_NxD):
  sq = jnp.sum(x_NxD * x_NxD, -1)
  return sq, inv_norm(sq)


def check_loss(loss_cfg: LossConfig) -> None:
  """Refuses the training levers that L(P) here does not model (they read W ẑ)."""
  for name in LossConfig.PROTO_LOGIT_TERMS:
    if getattr(loss_cfg, name) > 0:
      raise ValueError(f"loss.{name}={getattr(loss_cfg, name)} is not modelled by the bank's "
                       "loss (CE + λ_rec REC + λ_1 R1 + λ_2 R2); set it to 0")


class HeadInputs(NamedTuple):
  """The constants of L(P): backbone output for N = B*T tokens and the LM head."""

  z_NxD: jax.Array
  protos_KxD: jax.Array  # the bank at which curvature is evaluated
  wte_VxD: jax.Array
  targets_N: jax.Array
  mask_N: jax.Array  # bool: True on tokens that enter the loss
  mix_log_scale: jax.Array  # () the learned mixture scale's log (0 without one)


class OutputGrads(NamedTuple):
  """Per-token output side of the bank: ∂L_t/∂P = a_t g_tᵀ (rows idx_Nxk only)."""

  idx_Nxk: jax.Array  # int32 active prototype ids
  act_Nxk: jax.Array  # a_t on S_t (zero on masked tokens)
  g_NxD: jax.Array  # ∂ℓ_t/∂ẑ_t of the token's own loss (zero on masked tokens)
  mask_N: jax.Array  # bool


@nnx.jit
def _backbone_z(model, inputs_BxT):
  return model.backbone(inputs_BxT)[0]


def head_constants(model: Any, z_NxD, targets_N, mask_N, dtype: Any = None) -> HeadInputs:
  """HeadInputs from z and the model's bank, LM head and mixture scale, in `dtype`
  (default float32)."""
  dtype = jnp.float32 if dtype is None else dtype
  log_scale = (model.mix_log_scale[...] if model.cfg.mixture_scale == "learned"
               else jnp.zeros(()))
  return HeadInputs(z_NxD.astype(dtype), model.bank.protos[...].astype(dtype),
                    model.backbone.unembedding().astype(dtype), jnp.asarray(targets_N, jnp.int32),
                    jnp.asarray(mask_N, bool), jnp.asarray(log_scale, dtype))


def head_inputs(model: Any, batch: dict[str, Any], dtype: Any = None) -> HeadInputs:
  """Runs the backbone once; casts the head's constants to `dtype` (default float32)."""
  for key in ("inputs", "targets", "mask"):
    if key not in batch:
      raise ValueError(f"batch is missing {key!r}; a batch holds inputs, targets, mask (B, T)")
  check_model(model)
  inputs = jnp.asarray(batch["inputs"], jnp.int32)
  if inputs.ndim != 2 or np.shape(batch["targets"]) != inputs.shape or \
     np.shape(batch["mask"]) != inputs.shape:
    raise ValueError(f"inputs/targets/mask must share one (B, T) shape, got {inputs.shape}, "
                     f"{np.shape(batch['targets'])}, {np.shape(batch['mask'])}")
  z_NxD = _backbone_z(model, inputs).reshape(-1, model.cfg.d_model)
  return head_constants(model, z_NxD, np.reshape(batch["targets"], -1),
                        np.reshape(batch["mask"], -1), dtype)


def head_forward(protos_KxD: jax.Array, head: HeadInputs, model_cfg: ModelConfig, *,
                 path: Path = "full", tap: Tap | None = None) -> HeadOutput:
  """The model's head (model/head.py) at bank `protos_KxD`, in the inputs' dtype; its
  prototype layer runs the "xla" implementation (forward mode too, for jax.hessian)."""
  if path not in ("linear", "full"):
    raise ValueError(f"path={path!r}; use 'linear' (activations fixed) or 'full'")
  return prism_head(head.z_NxD, protos_KxD, head.wte_VxD, model_cfg,
                    mix_log_scale=head.mix_log_scale, mask_N=head.mask_N, tap=tap,
                    fixed_weights=path == "linear", implementation="xla")


def token_losses(out: HeadOutput, head: HeadInputs, loss_cfg: LossConfig):
  """Per-token (CE_N, REC_N), unmasked: prism_jax.losses' token_nll and token_rec."""
  return (losses.token_nll(out.logits, head.targets_N),
          losses.token_rec(head.z_NxD, out.protos.residual_NxD, loss_cfg.rec_kind))


def token_loss(out: HeadOutput, head: HeadInputs, loss_cfg: LossConfig) -> jax.Array:
  """ℓ_t = CE_t + λ_rec REC_t of every token (unmasked): the terms that read ẑ_t."""
  ce_N, rec_N = token_losses(out, head, loss_cfg)
  return ce_N + loss_cfg.lambda_rec * rec_N


def weighted_terms(out: HeadOutput, head: HeadInputs, loss_cfg: LossConfig,
                   names=TERMS["all"]) -> dict[str, jax.Array]:
  """The named terms of the training loss, weighted, as prism_jax.losses computes them."""
  p, m = out.protos, head.mask_N
  term = {"ce": lambda: losses.cross_entropy(out.logits, head.targets_N, m),
          "rec": lambda: loss_cfg.lambda_rec * losses.reconstruction(
              head.z_NxD, p.residual_NxD, m, loss_cfg.rec_kind),
          "r1": lambda: loss_cfg.lambda_r1 * losses.r1_clustering(p.col_min_dist_K),
          "r2": lambda: loss_cfg.lambda_r2 * losses.r2_clustering(p.row_min_dist_N, m)}
  return {n: term[n]() for n in names}


def bank_loss(protos_KxD: jax.Array, head: HeadInputs, model_cfg: ModelConfig,
              loss_cfg: LossConfig, *, path: Path = "full", terms: str = "all") -> jax.Array:
  """The training loss as a function of P. terms: "all" | "output" (CE + λ_rec REC, the
  ẑ-terms) | "clustering" (λ_1 R1 + λ_2 R2)."""
  if terms not in TERMS:
    raise ValueError(f"terms={terms!r}; use 'all', 'output' or 'clustering'")
  check_loss(loss_cfg)
  out = head_forward(protos_KxD, head, model_cfg, path=path)
  return sum(weighted_terms(out, head, loss_cfg, TERMS[terms]).values())


def output_grads_and_logits(head: HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig
                            ) -> tuple[OutputGrads, jax.Array]:
  """g_t = ∂ℓ_t/∂ẑ_t of every token from one vjp: the gradient of Σ_t ℓ_t w.r.t. the
  head's "bank" probe (ℓ_t depends on ẑ_t only), and the logits."""
  og, out = output_grads_and_head(head, model_cfg, loss_cfg)
  return og, out.logits


def output_grads_and_head(head: HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig
                          ) -> tuple[OutputGrads, HeadOutput]:
  """`output_grads_and_logits` with the whole head output (its layer statistics feed
  `clustering_curvature` without a second N x K pass)."""
  m = head.mask_N

  def summed(probe_1xNxD):
    out = head_forward(head.protos_KxD, head, model_cfg, path="linear",
                       tap=Tap({"bank": probe_1xNxD}))
    return jnp.sum(jnp.where(m, token_loss(out, head, loss_cfg), 0.0)), out

  g_1xNxD, out = jax.grad(summed, has_aux=True)(jnp.zeros((1,) + head.z_NxD.shape,
                                                          head.z_NxD.dtype))
  p = out.protos
  return OutputGrads(p.idx_Nxk, jnp.where(m[:, None], p.act_Nxk, 0.0),
                     jnp.where(m[:, None], g_1xNxD[0], 0.0), m), out


@functools.partial(jax.jit, static_argnames=("model_cfg", "loss_cfg"))
def output_grads_from_head(head: HeadInputs, model_cfg: ModelConfig,
                           loss_cfg: LossConfig) -> OutputGrads:
  """Per-token (idx, a, g, mask) of HeadInputs (see output_grads_and_logits)."""
  return output_grads_and_logits(head, model_cfg, loss_cfg)[0]


def output_grads(model: Any, batch: dict[str, Any], loss_cfg: LossConfig,
                 dtype: Any = None) -> OutputGrads:
  """Per-token (idx, a, g = ∂ℓ_t/∂ẑ_t, mask) for a batch dict (inputs/targets/mask, B×T)."""
  head = head_inputs(model, batch, dtype)
  return output_grads_from_head(head, check_model(model), loss_cfg)


def output_hessians(head: HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig,
                    logits_NxV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token output Hessians as (probs_NxV scaled, iso_N) so that, on valid tokens,

      G_t = Wᵀ diag(π_t) W − (Wᵀπ_t)(Wᵀπ_t)ᵀ  (CE, straight-through)  +  iso_t I  (REC, plain)

  Returns (pi_NxV masked, zero when CE does not reach ẑ) and iso_N (masked)."""
  m = head.mask_N.astype(head.z_NxD.dtype)
  if model_cfg.residual_routing == "straight_through":
    pi_NxV = jax.nn.softmax(logits_NxV, -1) * m[:, None]
    iso_N = jnp.zeros_like(m)
  else:
    pi_NxV = jnp.zeros_like(logits_NxV)
    scale_N = (1.0 / jnp.maximum(jnp.sum(head.z_NxD ** 2, -1), EPS)
               if loss_cfg.rec_kind == "relative" else jnp.ones_like(m))
    iso_N = 2.0 * loss_cfg.lambda_rec * scale_N * m
  return pi_NxV, iso_N


def per_token_G(head: HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig) -> jax.Array:
  """G_t for every token, (N, D, D): small sizes only (tests, exact per-token GN blocks)."""
  logits_NxV = head_forward(head.protos_KxD, head, model_cfg, path="linear").logits
  pi_NxV, iso_N = output_hessians(head, model_cfg, loss_cfg, logits_NxV)
  w = head.wte_VxD
  m_NxD = jnp.dot(pi_NxV, w, precision=_HI)
  g = jnp.einsum("nv,va,vb->nab", pi_NxV, w, w, precision=_HI)
  g = g - m_NxD[:, :, None] * m_NxD[:, None, :]
  return g + iso_N[:, None, None] * jnp.eye(w.shape[1], dtype=w.dtype)


def output_hessian_sum(head: HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig,
                       logits_NxV: jax.Array) -> jax.Array:
  """Σ_t G_t over valid tokens, (D, D), without forming per-token D×D matrices."""
  pi_NxV, iso_N = output_hessians(head, model_cfg, loss_cfg, logits_NxV)
  w = head.wte_VxD
  m_NxD = jnp.dot(pi_NxV, w, precision=_HI)
  g = jnp.dot(w.T * jnp.sum(pi_NxV, 0)[None, :], w, precision=_HI)
  g = g - jnp.dot(m_NxD.T, m_NxD, precision=_HI)
  return g + jnp.sum(iso_N) * jnp.eye(w.shape[1], dtype=w.dtype)


def _nearest(dist_NxK, mask_N):
  """Nearest valid token of each prototype (R1) and nearest prototype of each token (R2),
  lowest index on ties (jnp.argmin's pick, by plain reductions: XLA:CPU's variadic argmin
  took 0.2 s over the demo's 2048 x 16384 batch)."""
  col_d = jnp.where(mask_N[:, None], dist_NxK, jnp.inf)
  col_min, tok_of_K = first_extremum(col_d, 0, largest=False)
  proto_of_N = first_extremum(dist_NxK, 1, largest=False)[1]
  return tok_of_K, jnp.isfinite(col_min), proto_of_N


def clustering_curvature(head: HeadInputs, model_cfg: ModelConfig, loss_cfg: LossConfig, *,
                         blocks: bool = False, layer: PrototypeOutput | None = None):
  """Curvature of λ_1 R1 + λ_2 R2 w.r.t. each p_i; it is block-diagonal (local to p_i).

  With t*(i) the nearest valid token of prototype i, i*(t) the nearest prototype of token t,
  K' the prototypes with a valid token and N the valid tokens:
      C_i = λ_1/K' ∇²_p dist(p_i, z_{t*(i)}) + λ_2/N Σ_{t: i*(t)=i} ∇²_p dist(p_i, z_t).
  sqeuclidean: ∇²_p ‖p − z‖² = 2 I, so C_i = μ_i I exactly with
      μ_i = 2λ_1/K' + 2λ_2 n_i/N    (n_i = number of tokens whose nearest prototype is i).
  cosine: with u = p/‖p‖, v = z/‖z‖, c = uᵀv,
      ∇²_p (1 − cos) = (u vᵀ + v uᵀ + c (I − 3 u uᵀ)) / ‖p‖²,
  whose trace is c (D − 1)/‖p‖²; it vanishes along u (cosine is scale-invariant), so the
  cosine clustering terms add no curvature in the radial direction. The local isotropic
  approximation replaces C_i by μ_i I with μ_i = tr(C_i)/D (trace-matched):
      μ_i = (D−1)/(D ‖p_i‖²) (λ_1/K' c_{i,t*(i)} + λ_2/N Σ_{t: i*(t)=i} c_{i,t}).
  Returns mu_K, and with blocks=True also the exact C_KxDxD (small sizes).
  `layer`: the prototype layer's output on these tokens (masked by head.mask_N); for the
  cosine distance its row top-1 and column maxima are the arguments and values above, so
  μ comes without another N x K pass (the cache's pass 1).
  """
  if layer is not None and model_cfg.distance == "cosine" and not blocks:
    return _cosine_mu_from_layer(head, loss_cfg, layer)
  # The layer's N x K similarities (prototypes.similarity, the op's), with the arguments of
  # the extrema R1/R2 pick: the curvature of dist is local to each (token, prototype) pair.
  sim = similarity(head.z_NxD, head.protos_KxD)
  cos_NxK = sim.cos_NxK
  dist_NxK = 1.0 - cos_NxK if model_cfg.distance == "cosine" else sim.sqdist()
  tok_of_K, has_tok_K, proto_of_N = _nearest(dist_NxK, head.mask_N)
  dt = head.z_NxD.dtype
  num_k, d = head.protos_KxD.shape
  w1_K, w2_N = _extremum_weights(head, loss_cfg, has_tok_K)
  if model_cfg.distance == "sqeuclidean":
    mu_K = 2.0 * (w1_K + jax.ops.segment_sum(w2_N, proto_of_N, num_segments=num_k))
    if not blocks:
      return mu_K
    return mu_K, mu_K[:, None, None] * jnp.eye(d, dtype=dt)
  # Cosine: weights per (token, prototype) pair, R1 and R2 together.
  cos_r2_N = jnp.take_along_axis(cos_NxK, proto_of_N[:, None], axis=1)[:, 0]
  cos_r1_K = cos_NxK[tok_of_K, jnp.arange(num_k)]
  wc_K = (jax.ops.segment_sum(w2_N * cos_r2_N, proto_of_N, num_segments=num_k)
          + w1_K * cos_r1_K)
  _, inv_p = _norm_inv(head.protos_KxD)
  inv_sqp = inv_p ** 2
  mu_K = (d - 1) / d * inv_sqp * wc_K
  if not blocks:
    return mu_K
  w_NxK = (jax.nn.one_hot(proto_of_N, num_k, dtype=dt) * w2_N[:, None]
           + jax.nn.one_hot(tok_of_K, head.z_NxD.shape[0], dtype=dt).T * w1_K[None, :])
  u_KxD = head.protos_KxD * inv_p[:, None]
  _, inv_z = _norm_inv(head.z_NxD)
  v_NxD = head.z_NxD * inv_z[:, None]
  s_KxD = jnp.dot(w_NxK.T, v_NxD, precision=_HI)  # Σ_t w_ti v_t
  uu = u_KxD[:, :, None] * u_KxD[:, None, :]
  c = (u_KxD[:, :, None] * s_KxD[:, None, :] + s_KxD[:, :, None] * u_KxD[:, None, :]
       + wc_K[:, None, None] * (jnp.eye(d, dtype=dt) - 3.0 * uu))
  return mu_K, inv_sqp[:, None, None] * c


def _extremum_weights(head: HeadInputs, loss_cfg: LossConfig, has_tok_K: jax.Array):
  """(w1_K, w2_N): R1's weight of each prototype's nearest token, R2's of each token's
  nearest prototype."""
  dt = head.z_NxD.dtype
  valid = head.mask_N.astype(dt)
  n_valid = jnp.maximum(jnp.sum(valid), 1.0)
  k_with = jnp.maximum(jnp.sum(has_tok_K.astype(dt)), 1.0)
  w1_K = loss_cfg.lambda_r1 / k_with * has_tok_K.astype(dt)  # R1 weight of t*(i)
  # R2's weight of (t, i) is λ_2/N on the one pair (t, i*(t)): sums over tokens are
  # segment sums (no N x K one-hot: K is 8192+ on the demo's bank).
  return w1_K, loss_cfg.lambda_r2 / n_valid * valid


def _cosine_mu_from_layer(head: HeadInputs, loss_cfg: LossConfig,
                          layer: PrototypeOutput) -> jax.Array:
  """`clustering_curvature`'s cosine μ from the layer's statistics: i*(t) is the token's
  top-1 (lowest id on ties, as argmin of 1 − cos), c_{i,t*(i)} the column maximum over
  valid tokens (−inf where none: no R1 term)."""
  num_k, d = head.protos_KxD.shape
  has_tok_K = jnp.isfinite(layer.col_max_cos_K)
  w1_K, w2_N = _extremum_weights(head, loss_cfg, has_tok_K)
  proto_of_N = layer.idx_Nxk[:, 0]
  cos_r1_K = jnp.where(has_tok_K, layer.col_max_cos_K, 0.0)
  wc_K = (jax.ops.segment_sum(w2_N * layer.sim_Nxk[:, 0], proto_of_N, num_segments=num_k)
          + w1_K * cos_r1_K)
  _, inv_p = _norm_inv(head.protos_KxD)
  return (d - 1) / d * inv_p ** 2 * wc_K
