"""The probed functional model behind EK-FAC (ekfac.py): layer inputs and output-gradients.

Layers: per block qkv (D→3D), attention out (D→D), MLP fc (D→F), MLP proj (F→D), all with
bias; plus the bank as the linear map ẑ = Pᵀa (input a ∈ R^K, no bias; a held fixed, i.e.
the Gauss-Newton view of PRISM.md §4). The tied embedding / LM head is *not* included.
The loss is token cross-entropy *summed* over a segment's weighted tokens (`_summed_ce`).

Capture design (no hooks): `_forward` re-implements the model's forward on a plain dict of
arrays with a zero "probe" added to every linear layer's output; the gradient of the loss
w.r.t. the probes is the per-token δ, and the layer inputs come back as aux. It keeps the
input dtype (float64 under enable_x64). tests/test_ekfac.py pins it to the real model's logits
and to jax.grad of the real model, so a model change cannot silently diverge from it.

`capture` runs the whole backward as one program; `stream_capture` yields the same (a, δ)
one layer group at a time (bank, then blocks last to first) for ekfac.py's memory-bounded
scoring. Factor fitting, preconditioning and scoring live in ekfac.py.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.model.lm import PrismLM
from prism_jax.model.prototypes import mixture_weights

Batch = Mapping[str, np.ndarray]
_LN_EPS = 1e-5
_EPS = 1e-6  # the prototype layer's norm / sum guard


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
