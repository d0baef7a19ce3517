"""EK-FAC influence over every linear layer of the backbone and the prototype bank.

The baseline PRISM's cached attribution is measured against (PRISM.md §5; Grosse et al. 2023,
George et al. 2018). Conventions follow kronfluence (pomonam/kronfluence):

  * training loss = token cross-entropy *summed* over the valid tokens of a sequence;
    factors use labels sampled from the model (true Fisher) unless `empirical_fisher`;
  * per layer l with input a (bias: a 1 appended) and output-gradient δ:
      A_l = Σ_t a aᵀ / #tokens,  S_l = Σ_t δ δᵀ / #tokens,  A = Q_A diag Q_Aᵀ, S = Q_S diag Q_Sᵀ
      Λ_l = Σ_seq (Q_Sᵀ G_seq Q_A)² / #seq        (eigenvalue correction, G_seq = Σ_t δ aᵀ)
      precondition(G) = Q_S [(Q_Sᵀ G Q_A) / (Λ_l + λ_l)] Q_Aᵀ,  λ_l = 0.1 · mean(Λ_l) default
  * score(q, t) = Σ_l ⟨precondition(G_q), G_t⟩ = ∇L_qᵀ H⁻¹ ∇L_t. **Positive = the training
    sequence helps the query** (a step on it lowers the query loss); it is −I(q,t) in the
    Koh & Liang sign of PRISM.md §5.

Layers: per block qkv (D→3D), attention out (D→D), MLP fc (D→F), MLP proj (F→D), all with
bias; plus the bank as the linear map ẑ = Pᵀa (input a ∈ R^K, no bias; a held fixed, i.e.
the Gauss-Newton view of PRISM.md §4). The tied embedding / LM head is *not* included.

Memory-bounded scoring (`ekfac_scores`, default `layerwise`): `stream_capture` chains the
backward by hand one layer group at a time (bank, then blocks last to first), each group a
small program shared by every block, so the peak is one block's programs and per-sequence
gradients plus the query chunk's preconditioned gradients, whatever the depth.

Capture design (no hooks): `_forward` re-implements the model's forward on a plain dict of
arrays with a zero "probe" added to every linear layer's output; the gradient of the loss
w.r.t. the probes is the per-token δ, and the layer inputs come back as aux. It keeps the
input dtype (float64 under enable_x64). tests/test_ekfac.py pins it to the real model's logits
and to jax.grad of the real model, so a model change cannot silently diverge from it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.model.lm import PrismLM
from prism_jax.model.prototypes import mixture_weights

Batch = Mapping[str, np.ndarray]
_LN_EPS = 1e-5
_EPS = 1e-6  # the prototype layer's norm / sum guard


@dataclasses.dataclass(frozen=True)
class EkfacConfig:
  damping: float | None = None  # None: 0.1 × mean(Λ_l) per layer (kronfluence heuristic)
  include_bank: bool = True  # the prototype bank as a linear layer (PrismLM only)
  empirical_fisher: bool = False  # False: labels sampled from the model for the factors
  seed: int = 0  # label sampling

  def __post_init__(self):
    if self.damping is not None and self.damping < 0:
      raise ValueError(f"ekfac.damping must be >= 0 or None, got {self.damping}")


def extract_params(model, dtype=None) -> dict[str, Any]:
  """The model's weights as a plain dict of arrays, linear kernels as (in, out) matrices."""
  bb = model.backbone
  cast = (lambda x: jnp.asarray(x[...], dtype)) if dtype else (lambda x: jnp.asarray(x[...]))
  d = model.cfg.d_model
  p: dict[str, Any] = {"wte": cast(bb.wte), "wpe": cast(bb.wpe),
                       "ln_f": (cast(bb.ln_f.scale), cast(bb.ln_f.bias)), "blocks": []}
  for blk in bb.blocks:
    at, mlp = blk.attn, blk.mlp
    p["blocks"].append({
        "ln1": (cast(blk.ln1.scale), cast(blk.ln1.bias)),
        "ln2": (cast(blk.ln2.scale), cast(blk.ln2.bias)),
        "qkv": (cast(at.qkv_kernel).reshape(d, -1), cast(at.qkv_bias).reshape(-1)),
        "attn_out": (cast(at.out_kernel).reshape(-1, d), cast(at.out_bias)),
        "mlp_fc": (cast(mlp.fc_kernel), cast(mlp.fc_bias)),
        "mlp_proj": (cast(mlp.proj_kernel), cast(mlp.proj_bias)),
    })
  if isinstance(model, PrismLM):
    p["bank"] = cast(model.bank.protos)
  return p


def layer_names(model, include_bank: bool = True) -> list[str]:
  names = [f"block{i}.{n}" for i in range(model.cfg.n_layers)
           for n in ("qkv", "attn_out", "mlp_fc", "mlp_proj")]
  if include_bank and isinstance(model, PrismLM):
    names.append("bank")
  return names


def _ln(x, scale_bias):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + _LN_EPS) * scale_bias[0] + scale_bias[1]


_BLOCK_LAYERS = ("qkv", "attn_out", "mlp_fc", "mlp_proj")


def _embed(p, tokens_BxT):
  return p["wte"][tokens_BxT] + p["wpe"][jnp.arange(tokens_BxT.shape[1])][None]


def _block(blk, x, probes, mcfg):
  """One transformer block; probes / returned inputs are keyed by _BLOCK_LAYERS names."""
  hi = jax.lax.Precision.HIGHEST
  batch, seq, _ = x.shape
  h_, dh = mcfg.n_heads, mcfg.head_dim
  acts = {}

  def linear(name, x, w_b):
    w, b = w_b
    if name in probes:
      acts[name] = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], -1)
    return jnp.einsum("bti,io->bto", x, w, precision=hi) + b + probes.get(name, 0.0)

  causal_TxT = jnp.tril(jnp.ones((seq, seq), bool))
  qkv = linear("qkv", _ln(x, blk["ln1"]), blk["qkv"]).reshape(batch, seq, 3, h_, dh)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  scores = jnp.einsum("bthk,bshk->bhts", q, k, precision=hi) / jnp.sqrt(
      jnp.asarray(dh, x.dtype))
  scores = jnp.where(causal_TxT, scores, jnp.finfo(scores.dtype).min)
  ctx = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, -1), v, precision=hi)
  x = x + linear("attn_out", ctx.reshape(batch, seq, h_ * dh), blk["attn_out"])
  hid = jax.nn.gelu(linear("mlp_fc", _ln(x, blk["ln2"]), blk["mlp_fc"]), approximate=True)
  return x + linear("mlp_proj", hid, blk["mlp_proj"]), acts


def _head(p, probes, x, mcfg):
  """ln_f, the prototype layer (bank probe / input a under "bank") and the tied LM head."""
  hi = jax.lax.Precision.HIGHEST
  acts = {}
  z = _ln(x, p["ln_f"])
  head_in = z
  if "bank" in p:
    protos = p["bank"]
    unit_z = z * jax.lax.rsqrt(jnp.maximum(jnp.sum(z * z, -1, keepdims=True), _EPS * _EPS))
    unit_p = protos * jax.lax.rsqrt(jnp.maximum(jnp.sum(protos * protos, -1, keepdims=True),
                                                _EPS * _EPS))
    cos = jnp.einsum("btd,kd->btk", unit_z, unit_p, precision=hi)
    sim, idx = jax.lax.top_k(cos, mcfg.k)
    act = mixture_weights(sim, mcfg.mixture)
    a_BxTxK = jnp.sum(jax.nn.one_hot(idx, protos.shape[0], dtype=act.dtype) * act[..., None],
                      axis=-2)
    z_hat = jnp.einsum("btk,kd->btd", a_BxTxK, protos, precision=hi)
    if "bank" in probes:
      acts["bank"] = a_BxTxK
      z_hat = z_hat + probes["bank"]
    if mcfg.residual_routing == "straight_through":
      head_in = z - jax.lax.stop_gradient(z_hat) + z_hat
    else:
      head_in = (z - z_hat) + z_hat
  return jnp.einsum("btd,vd->btv", head_in, p["wte"], precision=hi), acts


def _forward(p, probes, tokens_BxT, mcfg):
  """Logits (B, T, V) and the per-layer inputs (bias column appended) of the probed layers."""
  x = _embed(p, tokens_BxT)
  acts = {}
  for i, blk in enumerate(p["blocks"]):
    local = {n: probes[f"block{i}.{n}"] for n in _BLOCK_LAYERS if f"block{i}.{n}" in probes}
    x, a = _block(blk, x, local, mcfg)
    acts.update({f"block{i}.{n}": v for n, v in a.items()})
  logits, a = _head(p, probes, x, mcfg)
  acts.update(a)
  return logits, acts


def _summed_ce(logits_BxTxV, labels_BxT, weight_BxT):
  logp = jax.nn.log_softmax(logits_BxTxV, -1)
  nll = -jnp.take_along_axis(logp, labels_BxT[..., None], -1)[..., 0]
  return jnp.sum(nll * weight_BxT)


def _probe_shapes(p, names, batch, seq):
  out = {}
  for name in names:
    if name == "bank":
      out[name] = (batch, seq, p["bank"].shape[1])
    else:
      i, lname = name.split(".")
      out[name] = (batch, seq, p["blocks"][int(i[5:])][lname][0].shape[1])
  return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _capture(mcfg, names, p, tokens_BxT, labels_BxT, weight_SxBxT):
  """Per-segment output-gradients δ (S, B, T, out) and layer inputs a (B, T, in).

  Segment s's loss is Σ_t weight[s, b, t] · CE_t; its parameter gradient is Σ_t δ_s aᵀ.
  """
  batch, seq = tokens_BxT.shape
  dtype = p["wte"].dtype
  probes0 = {n: jnp.zeros(s, dtype) for n, s in _probe_shapes(p, names, batch, seq).items()}

  def loss(probes, w_BxT):
    logits, acts = _forward(p, probes, tokens_BxT, mcfg)
    return _summed_ce(logits, labels_BxT, w_BxT), acts

  def seg_grad(w_BxT):
    return jax.grad(loss, has_aux=True)(probes0, w_BxT)

  deltas, acts = jax.vmap(seg_grad, out_axes=(0, None))(weight_SxBxT)
  return deltas, acts


@functools.partial(jax.jit, static_argnums=(0,))
def _sample_labels(mcfg, p, tokens_BxT, key):
  logits, _ = _forward(p, {}, tokens_BxT, mcfg)
  return jax.random.categorical(key, logits.astype(jnp.float32), -1).astype(jnp.int32)


def segment_weights(batch: Batch, by_example: bool) -> tuple[np.ndarray, np.ndarray]:
  """(S, B, T) 0/1 weights and (S, B) example ids (-1 = empty) splitting rows into segments.

  by_example=False: one segment per row (the whole row = one training sequence).
  """
  mask = np.asarray(batch["mask"], bool)
  if not by_example:
    return mask[None].astype(np.float32), np.asarray(batch["row_id"], np.int64)[None]
  ex = np.asarray(batch["example_id"])
  ids_per_row = [np.unique(ex[b][mask[b]]) for b in range(mask.shape[0])]
  num_seg = max(1, max(len(u) for u in ids_per_row))
  w = np.zeros((num_seg,) + mask.shape, np.float32)
  seg_ids = np.full((num_seg, mask.shape[0]), -1, np.int64)
  for b, uniq in enumerate(ids_per_row):
    for s, e in enumerate(uniq):
      w[s, b] = mask[b] & (ex[b] == e)
      seg_ids[s, b] = e
  return w, seg_ids


class Capture(NamedTuple):
  acts: dict[str, jax.Array]  # (B, T, in)
  deltas: dict[str, jax.Array]  # (S, B, T, out)


def capture(model_or_params, mcfg, names, batch: Batch, labels_BxT=None,
            weight_SxBxT=None) -> Capture:
  """Layer inputs and per-segment output-gradients of the summed CE for one batch."""
  p = model_or_params if isinstance(model_or_params, dict) else extract_params(model_or_params)
  dtype = p["wte"].dtype
  labels = batch["targets"] if labels_BxT is None else labels_BxT
  if weight_SxBxT is None:
    weight_SxBxT = np.asarray(batch["mask"], bool)[None]
  deltas, acts = _capture(mcfg, tuple(names), p, jnp.asarray(batch["inputs"]),
                          jnp.asarray(labels, jnp.int32), jnp.asarray(weight_SxBxT, dtype))
  return Capture(acts, deltas)


def per_sequence_grads(cap: Capture) -> dict[str, jax.Array]:
  """G_seq = Σ_t δ aᵀ per segment: (S, B, out, in)."""
  return {n: jnp.einsum("sbto,bti->sboi", cap.deltas[n], cap.acts[n],
                        precision=jax.lax.Precision.HIGHEST) for n in cap.acts}


class Factors(NamedTuple):
  q_a: dict[str, jax.Array]  # (in, in) eigenvectors of A_l
  q_s: dict[str, jax.Array]  # (out, out) eigenvectors of S_l
  lam: dict[str, jax.Array]  # (out, in) corrected eigenvalues Λ_l
  damping: dict[str, jax.Array]  # λ_l actually used (scalars)
  num_tokens: int
  num_sequences: int


_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnums=(0, 1))
def _cov_step(mcfg, names, p, cov, tokens_BxT, labels_BxT, mask_BxT):
  deltas, acts = _capture(mcfg, names, p, tokens_BxT, labels_BxT, mask_BxT[None])
  m = mask_BxT[..., None]
  new = {n: (jnp.einsum("bti,btj->ij", acts[n] * m, acts[n], precision=_HI),
             jnp.einsum("bti,btj->ij", deltas[n][0] * m, deltas[n][0], precision=_HI))
         for n in names}
  return new if cov is None else jax.tree.map(jnp.add, cov, new)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _lam_step(mcfg, names, p, lam, q_a, q_s, tokens_BxT, labels_BxT, mask_BxT):
  deltas, acts = _capture(mcfg, names, p, tokens_BxT, labels_BxT, mask_BxT[None])
  grads = per_sequence_grads(Capture(acts, deltas))
  out = {}
  for n in names:
    rot = jnp.einsum("om,bmn,ni->boi", q_s[n].T, grads[n][0], q_a[n], precision=_HI)
    out[n] = lam[n] + jnp.sum(rot * rot, 0)
  return out


@jax.jit
def _eigvecs(cov, num_tokens):
  return jax.tree.map(lambda c: jnp.linalg.eigh(c / num_tokens)[1], cov)


def fit_factors(model, batches: Iterable[Batch], cfg: EkfacConfig = EkfacConfig(), *,
                lambda_batches: Iterable[Batch] | None = None, dtype=None) -> Factors:
  """Two streaming passes: covariances → eigenbases, then the eigenvalue correction Λ.

  `batches` is iterated once (pass 1); `lambda_batches` (default: `batches` again, so pass a
  re-iterable) once more. Memory: the factors plus one batch's activations.
  """
  p = extract_params(model, dtype)
  mcfg, names = model.cfg, tuple(layer_names(model, cfg.include_bank))
  key = jax.random.key(cfg.seed)
  fdt = p["wte"].dtype

  def args(batch, step):
    tokens = jnp.asarray(batch["inputs"], jnp.int32)
    labels = (jnp.asarray(batch["targets"], jnp.int32) if cfg.empirical_fisher else
              _sample_labels(mcfg, p, tokens, jax.random.fold_in(key, step)))
    return tokens, labels, jnp.asarray(batch["mask"], fdt)

  cov, num_tokens = None, 0
  for step, batch in enumerate(batches):
    cov = _cov_step(mcfg, names, p, cov, *args(batch, step))
    num_tokens += int(np.asarray(batch["mask"]).sum())
  if cov is None or num_tokens == 0:
    raise ValueError("fit_factors got no valid training tokens")
  q_a = _eigvecs({n: c[0] for n, c in cov.items()}, num_tokens)
  q_s = _eigvecs({n: c[1] for n, c in cov.items()}, num_tokens)
  del cov

  lam = {n: jnp.zeros((q_s[n].shape[0], q_a[n].shape[0]), fdt) for n in names}
  num_seq = 0
  for step, batch in enumerate(batches if lambda_batches is None else lambda_batches):
    lam = _lam_step(mcfg, names, p, lam, q_a, q_s, *args(batch, step))
    num_seq += int(np.asarray(batch["mask"]).shape[0])
  lam = {n: v / num_seq for n, v in lam.items()}
  damping = {n: (0.1 * jnp.mean(lam[n]) if cfg.damping is None
                 else jnp.asarray(cfg.damping, fdt)) for n in names}
  return Factors(q_a, q_s, lam, damping, num_tokens, num_seq)


@jax.jit
def _precondition(q_a, q_s, lam, damping, grads):
  out = {}
  for n, g in grads.items():
    rot = jnp.einsum("om,...mn,ni->...oi", q_s[n].T, g, q_a[n], precision=_HI)
    rot = rot / (lam[n] + damping[n])
    out[n] = jnp.einsum("mo,...oi,ni->...mn", q_s[n], rot, q_a[n], precision=_HI)
  return out


def precondition(factors: Factors, grads: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Q_S [(Q_Sᵀ G Q_A) / (Λ + λ)] Q_Aᵀ for gradients (..., out, in)."""
  grads = dict(grads)
  sub = lambda d: {n: d[n] for n in grads}
  return _precondition(sub(factors.q_a), sub(factors.q_s), sub(factors.lam),
                       sub(factors.damping), grads)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _query_step(mcfg, names, p, q_a, q_s, lam, damping, tokens_BxT, labels_BxT, mask_BxT):
  deltas, acts = _capture(mcfg, names, p, tokens_BxT, labels_BxT, mask_BxT[None])
  grads = {n: g[0] for n, g in per_sequence_grads(Capture(acts, deltas)).items()}
  return _precondition(q_a, q_s, lam, damping, grads)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _score_step(mcfg, names, p, pre_q, tokens_BxT, labels_BxT, weight_SxBxT):
  deltas, acts = _capture(mcfg, names, p, tokens_BxT, labels_BxT, weight_SxBxT)
  grads = per_sequence_grads(Capture(acts, deltas))
  return sum(jnp.einsum("qoi,sboi->qsb", pre_q[n], grads[n], precision=_HI) for n in names)


# Layer-group streaming: the same per-sequence gradients as `_capture`, computed one group
# (the bank, then each block from the last) at a time by a hand-chained backward. Each piece
# is a small program compiled once and reused by every block (equal shapes), so peak memory
# is one block's programs and activations, not the whole model's backward at once.
_embed_jit = jax.jit(_embed)


@functools.partial(jax.jit, static_argnums=(0,))
def _block_fwd(mcfg, blk, x_BxTxD):
  return _block(blk, x_BxTxD, {}, mcfg)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _head_bwd(mcfg, with_bank, head_p, x_BxTxD, labels_BxT, weight_SxBxT):
  """Per-segment ∂loss/∂x (S, B, T, D), the bank's δ (S, B, T, D) and input a (B, T, K)."""
  probes0 = {"bank": jnp.zeros(x_BxTxD.shape, x_BxTxD.dtype)} if with_bank else {}

  def loss(x, probes, w_BxT):
    logits, acts = _head(head_p, probes, x, mcfg)
    return _summed_ce(logits, labels_BxT, w_BxT), acts

  def seg(w_BxT):
    (g_x, g_probes), acts = jax.grad(loss, argnums=(0, 1), has_aux=True)(
        x_BxTxD, probes0, w_BxT)
    return g_x, g_probes, acts

  return jax.vmap(seg, out_axes=(0, 0, None))(weight_SxBxT)


@functools.partial(jax.jit, static_argnums=(0,))
def _block_bwd(mcfg, blk, x_BxTxD, g_out_SxBxTxD):
  """Per-segment cotangents through one block: ∂/∂x_in, its layers' δ and inputs a."""
  batch, seq, _ = x_BxTxD.shape
  probes0 = {n: jnp.zeros((batch, seq, blk[n][0].shape[1]), x_BxTxD.dtype)
             for n in _BLOCK_LAYERS}
  _, vjp, acts = jax.vjp(lambda x, pr: _block(blk, x, pr, mcfg), x_BxTxD, probes0,
                         has_aux=True)
  g_in, deltas = jax.vmap(vjp)(g_out_SxBxTxD)
  return g_in, deltas, acts


def stream_capture(p, mcfg, names, tokens_BxT, labels_BxT, weight_SxBxT):
  """Yields (group names, Capture) per layer group, keyed by the group's local names
  (_BLOCK_LAYERS for block i, "bank"), bank first then blocks last to first."""
  names = set(names)
  xs = [_embed_jit(p, tokens_BxT)]
  for blk in p["blocks"]:
    xs.append(_block_fwd(mcfg, blk, xs[-1]))
  head_p = {k: p[k] for k in ("wte", "ln_f", "bank") if k in p}
  g, d_bank, a_bank = _head_bwd(mcfg, "bank" in names, head_p, xs.pop(), labels_BxT,
                                weight_SxBxT)
  if "bank" in names:
    yield ("bank",), Capture(a_bank, d_bank)
  for i in reversed(range(len(p["blocks"]))):
    g, deltas, acts = _block_bwd(mcfg, p["blocks"][i], xs.pop(), g)
    yield tuple(f"block{i}.{n}" for n in _BLOCK_LAYERS), Capture(acts, deltas)


@jax.jit
def _group_precondition(q_a, q_s, lam, damping, acts, deltas):
  grads = {n: g[0] for n, g in per_sequence_grads(Capture(acts, deltas)).items()}
  return _precondition(q_a, q_s, lam, damping, grads)


@jax.jit
def _group_score(pre_q, acts, deltas):
  grads = per_sequence_grads(Capture(acts, deltas))
  return sum(jnp.einsum("qoi,sboi->qsb", pre_q[n], grads[n], precision=_HI) for n in grads)


def _local(name):
  return name.split(".")[-1]


def _query_layerwise(mcfg, names, p, fac, tokens_BxT, labels_BxT, mask_BxT):
  """Preconditioned query gradients, group by group: {group: {local name: (Q, out, in)}}."""
  pre = {}
  for group, cap in stream_capture(p, mcfg, names, tokens_BxT, labels_BxT, mask_BxT[None]):
    sub = [{_local(n): d[n] for n in group} for d in fac]
    pre[group] = _group_precondition(*sub, cap.acts, cap.deltas)
  return pre


def _query_whole(mcfg, names, p, fac, tokens_BxT, labels_BxT, mask_BxT):
  return _query_step(mcfg, names, p, *fac, tokens_BxT, labels_BxT, mask_BxT)


def _score_layerwise(mcfg, names, p, pre_q, tokens_BxT, labels_BxT, weight_SxBxT):
  total = 0.0
  for group, cap in stream_capture(p, mcfg, names, tokens_BxT, labels_BxT, weight_SxBxT):
    total = total + _group_score(pre_q[group], cap.acts, cap.deltas)
  return total


def _row_chunks(batch: Batch, rows: int | None):
  """Splits a batch into `rows`-row chunks; a short (last) chunk is padded (mask False, ids
  -1) so that one compiled shape serves every chunk. rows=None: the batch as it is."""
  num = np.asarray(batch["inputs"]).shape[0]
  if rows is None or num == rows:
    yield batch
    return
  for start in range(0, num, rows):
    sub = {k: np.asarray(v)[start:start + rows] for k, v in batch.items()}
    have = sub["inputs"].shape[0]
    if have < rows:
      fill = lambda k: False if k == "mask" else (-1 if k in ("example_id", "offset",
                                                              "row_id") else 0)
      sub = {k: np.concatenate([v, np.full((rows - have,) + v.shape[1:], fill(k), v.dtype)])
             for k, v in sub.items()}
    yield sub


def query_grads(model, query: Batch, cfg: EkfacConfig = EkfacConfig(), dtype=None):
  """Per-query-row gradients of the summed CE over `query["mask"]` positions: (Q, out, in)."""
  p = extract_params(model, dtype)
  names = tuple(layer_names(model, cfg.include_bank))
  cap = capture(p, model.cfg, names, query)
  return {n: g[0] for n, g in per_sequence_grads(cap).items()}


def ekfac_scores(model, factors: Factors, query: Batch, train_batches, *,
                 cfg: EkfacConfig = EkfacConfig(), query_batch_size: int | None = None,
                 train_batch_size: int | None = None, layerwise: bool = True,
                 by_example: bool = True, dtype=None) -> tuple[np.ndarray, np.ndarray]:
  """Influence of every training sequence on every query row: (Q, E) scores and E ids.

  Query rows are processed `query_batch_size` at a time, each chunk streaming over
  `train_batches` (a re-iterable or a zero-argument callable returning an iterable) once,
  `train_batch_size` rows at a time (default: as the batches come): memory ∝
  (query_batch_size + train rows) × #params, time ∝ #chunks — kronfluence's trade-off.
  `layerwise` (default) backpropagates one layer group at a time (`stream_capture`), so
  neither the whole model's backward program nor all layers' per-sequence gradients are
  held at once, and captures query rows `train_batch_size` at a time too; False runs the
  whole capture as one program (same scores).
  Sequences are documents (example ids) when `by_example`, else rows (row ids).
  The query loss is the summed CE over `query["mask"]`, the same convention as training.
  """
  p = extract_params(model, dtype)
  names = tuple(layer_names(model, cfg.include_bank))
  num_q = np.asarray(query["inputs"]).shape[0]
  qbs = num_q if query_batch_size is None else int(query_batch_size)
  if qbs <= 0:
    raise ValueError(f"query_batch_size must be positive, got {query_batch_size}")
  if train_batch_size is not None and train_batch_size <= 0:
    raise ValueError(f"train_batch_size must be positive, got {train_batch_size}")
  fdt = p["wte"].dtype
  fac = [{n: d[n] for n in names} for d in (factors.q_a, factors.q_s, factors.lam,
                                           factors.damping)]
  query_fn, score_fn = ((_query_layerwise, _score_layerwise) if layerwise else
                        (_query_whole, _score_step))
  scores: dict[int, np.ndarray] = {}
  for start in range(0, num_q, qbs):
    sl = slice(start, start + qbs)
    chunk = {k: np.asarray(query[k])[sl] for k in ("inputs", "targets", "mask")}
    # Layerwise, the query rows are captured train_batch_size at a time (padded): the same
    # compiled programs as the training side, and only the preconditioned gradients grow.
    parts = [query_fn(model.cfg, names, p, fac, jnp.asarray(c["inputs"], jnp.int32),
                      jnp.asarray(c["targets"], jnp.int32), jnp.asarray(c["mask"], fdt))
             for c in _row_chunks(chunk, train_batch_size if layerwise else None)]
    pre_q = jax.tree.map(lambda *x: jnp.concatenate(x)[:len(chunk["inputs"])], *parts)
    del parts
    batches = train_batches() if callable(train_batches) else train_batches
    for big in batches:
      for batch in _row_chunks(big, train_batch_size):
        weights, seg_ids = segment_weights(batch, by_example)
        s_QxSxB = np.asarray(score_fn(model.cfg, names, p, pre_q,
                                      jnp.asarray(batch["inputs"], jnp.int32),
                                      jnp.asarray(batch["targets"], jnp.int32),
                                      jnp.asarray(weights, fdt)))
        for (s, b), e in np.ndenumerate(seg_ids):
          if e < 0:
            continue
          if e not in scores:
            scores[int(e)] = np.zeros(num_q, np.float64)
          scores[int(e)][sl] += s_QxSxB[:, s, b]
    del pre_q
  ids = np.asarray(sorted(scores), np.int64)
  return np.stack([scores[e] for e in ids], 1) if len(ids) else np.zeros((num_q, 0)), ids
