"""Layer inputs and output-gradients of the real model, for EK-FAC (ekfac.py).

Layers: per block qkv (D→3D), attention out (D→D), MLP fc (D→F), MLP proj (F→D), all with
bias; plus the bank as the linear map ẑ = Pᵀa (input a ∈ R^K, no bias; a held fixed, i.e.
the Gauss-Newton view of PRISM.md §4). The tied embedding / LM head is *not* included.
The loss is token cross-entropy (prism_jax.losses.token_nll) *summed* over a segment's
weighted tokens.

Capture: the real NNX modules run with a `Tap` (prism_jax/model/tap.py), which adds a zero
probe to every named linear output and records that layer's input; the gradient w.r.t.
the probes is the per-token δ. The model is passed as nnx (graphdef, state); `split_model`
casts the state to float64 for the references (the modules then compute in float64).

`capture` runs the whole backward as one program; `stream_capture` yields the same (a, δ)
one layer group at a time (bank, then blocks last to first) for ekfac.py's memory-bounded
scoring: the forward is run block by block (`Backbone.embed`, each `Block`,
`Backbone.final` + `head`), and the backward is chained by hand through the same pieces,
each a small program compiled once and reused by every block (equal shapes and graphdefs),
so peak memory is one block's programs and activations, not the whole model's backward.
Factor fitting, preconditioning and scoring live in ekfac.py.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax.losses import token_nll
from prism_jax.model.lm import PrismLM
from prism_jax.model.tap import BLOCK_LAYERS, Tap

Batch = Mapping[str, np.ndarray]


class Split(NamedTuple):
  """The model as nnx (graphdef, state): what the jitted capture programs take."""

  graphdef: Any
  state: Any

  @property
  def dtype(self):
    """The parameters' float dtype (float64 for the references)."""
    return jax.tree.leaves(self.state)[0].dtype


def split_model(model, dtype=None) -> Split:
  """nnx.split of the model, floating parameters cast to `dtype` when given."""
  graphdef, state = nnx.split(model)
  if dtype is not None:
    state = jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  return Split(graphdef, state)


def layer_names(model, include_bank: bool = True) -> list[str]:
  if model.cfg.arch != "gpt2":
    raise ValueError(f"EK-FAC captures the GPT-2 backbone's layers; model.arch="
                     f"{model.cfg.arch!r} is not supported by it yet (cached PRISM "
                     "attribution, grad_dot and TRAK are)")
  names = [f"block{i}.{n}" for i in range(model.cfg.n_layers) for n in BLOCK_LAYERS]
  if include_bank and isinstance(model, PrismLM):
    names.append("bank")
  return names


def _probes(cfg, names, batch: int, seq: int, dtype) -> dict[str, jax.Array]:
  """Zero probes (B, T, out) for the named layers."""
  out = {"qkv": 3 * cfg.d_model, "attn_out": cfg.d_model, "mlp_fc": cfg.d_mlp,
         "mlp_proj": cfg.d_model, "bank": cfg.d_model}
  return {n: jnp.zeros((batch, seq, out[n.split(".")[-1]]), dtype) for n in names}


def _summed_ce(logits_BxTxV, labels_BxT, weight_BxT):
  return jnp.sum(token_nll(logits_BxTxV, labels_BxT) * weight_BxT)


def _positions(x_BxTxD):
  batch, seq = x_BxTxD.shape[:2]
  return jnp.broadcast_to(jnp.arange(seq), (batch, seq))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _capture(graphdef, names, state, tokens_BxT, labels_BxT, weight_SxBxT):
  """Per-segment output-gradients δ (S, B, T, out) and layer inputs a (B, T, in).

  Segment s's loss is Σ_t weight[s, b, t] · CE_t; its parameter gradient is Σ_t δ_s aᵀ.
  """
  model = nnx.merge(graphdef, state)
  probes0 = _probes(model.cfg, names, *tokens_BxT.shape, weight_SxBxT.dtype)

  def loss(probes, w_BxT):
    tap = Tap(probes)
    logits = model(tokens_BxT, tap=tap).logits_BxTxV
    return _summed_ce(logits, labels_BxT, w_BxT), tap.inputs

  def seg_grad(w_BxT):
    return jax.grad(loss, has_aux=True)(probes0, w_BxT)

  deltas, acts = jax.vmap(seg_grad, out_axes=(0, None))(weight_SxBxT)
  return deltas, acts


@functools.partial(jax.jit, static_argnums=(0,))
def _sample_labels(graphdef, state, tokens_BxT, key):
  logits = nnx.merge(graphdef, state)(tokens_BxT).logits_BxTxV
  return jax.random.categorical(key, logits.astype(jnp.float32), -1).astype(jnp.int32)


def sample_labels(split: Split, tokens_BxT, key) -> jax.Array:
  """Labels drawn from the model's predictive distribution (the true Fisher's)."""
  return _sample_labels(split.graphdef, split.state, tokens_BxT, key)


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


def capture(model, names, batch: Batch, labels_BxT=None, weight_SxBxT=None, *,
            dtype=None) -> Capture:
  """Layer inputs and per-segment output-gradients of the summed CE for one batch.
  `model`: the model or its `split_model` (dtype casts the model's parameters)."""
  split = model if isinstance(model, Split) else split_model(model, dtype)
  labels = batch["targets"] if labels_BxT is None else labels_BxT
  if weight_SxBxT is None:
    weight_SxBxT = np.asarray(batch["mask"], bool)[None]
  deltas, acts = _capture(split.graphdef, tuple(names), split.state,
                          jnp.asarray(batch["inputs"]), jnp.asarray(labels, jnp.int32),
                          jnp.asarray(weight_SxBxT, split.dtype))
  return Capture(acts, deltas)


def per_sequence_grads(cap: Capture) -> dict[str, jax.Array]:
  """G_seq = Σ_t δ aᵀ per segment: (S, B, out, in)."""
  return {n: jnp.einsum("sbto,bti->sboi", cap.deltas[n], cap.acts[n],
                        precision=jax.lax.Precision.HIGHEST) for n in cap.acts}


# Layer-group streaming: the same per-sequence gradients as `_capture`, one group (the
# bank, then each block from the last) at a time, through the real modules' pieces.
@functools.partial(jax.jit, static_argnums=(0,))
def _embed(graphdef, state, tokens_BxT):
  backbone = nnx.merge(graphdef, state).backbone
  return backbone.embed(tokens_BxT, backbone.positions(tokens_BxT))


@functools.partial(jax.jit, static_argnums=(0,))
def _block_fwd(block_graphdef, block_state, x_BxTxD):
  return nnx.merge(block_graphdef, block_state)(x_BxTxD, _positions(x_BxTxD))[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _head_bwd(graphdef, with_bank, state, x_BxTxD, labels_BxT, weight_SxBxT):
  """Per-segment ∂loss/∂x (S, B, T, D), the bank's δ (S, B, T, D) and input a (B, T, K)."""
  model = nnx.merge(graphdef, state)
  names = ("bank",) if with_bank else ()
  probes0 = _probes(model.cfg, names, *x_BxTxD.shape[:2], x_BxTxD.dtype)

  def loss(x, probes, w_BxT):
    tap = Tap(probes)
    logits = model.head(model.backbone.final(x), tap=tap).logits_BxTxV
    return _summed_ce(logits, labels_BxT, w_BxT), tap.inputs

  def seg(w_BxT):
    (g_x, g_probes), acts = jax.grad(loss, argnums=(0, 1), has_aux=True)(
        x_BxTxD, probes0, w_BxT)
    return g_x, g_probes, acts

  return jax.vmap(seg, out_axes=(0, 0, None))(weight_SxBxT)


@functools.partial(jax.jit, static_argnums=(0,))
def _block_bwd(block_graphdef, block_state, x_BxTxD, g_out_SxBxTxD):
  """Per-segment cotangents through one block: ∂/∂x_in, its layers' δ and inputs a."""
  block = nnx.merge(block_graphdef, block_state)
  probes0 = _probes(block.attn.cfg, BLOCK_LAYERS, *x_BxTxD.shape[:2], x_BxTxD.dtype)

  def fwd(x, probes):
    tap = Tap(probes)
    return block(x, _positions(x), tap=tap)[0], tap.inputs

  _, vjp, acts = jax.vjp(fwd, x_BxTxD, probes0, has_aux=True)
  g_in, deltas = jax.vmap(vjp)(g_out_SxBxTxD)
  return g_in, deltas, acts


def stream_capture(split: Split, names, tokens_BxT, labels_BxT, weight_SxBxT):
  """Yields (group names, Capture) per layer group, keyed by the group's local names
  (BLOCK_LAYERS for block i, "bank"), bank first then blocks last to first."""
  names = set(names)
  blocks = [split_model(b) for b in nnx.merge(split.graphdef, split.state).backbone.blocks]
  xs = [_embed(split.graphdef, split.state, tokens_BxT)]
  for blk in blocks:
    xs.append(_block_fwd(blk.graphdef, blk.state, xs[-1]))
  g, d_bank, a_bank = _head_bwd(split.graphdef, "bank" in names, split.state, xs.pop(),
                                labels_BxT, weight_SxBxT)
  if "bank" in names:
    yield ("bank",), Capture(a_bank, d_bank)
  for i in reversed(range(len(blocks))):
    g, deltas, acts = _block_bwd(blocks[i].graphdef, blocks[i].state, xs.pop(), g)
    yield tuple(f"block{i}.{n}" for n in BLOCK_LAYERS), Capture(acts, deltas)
