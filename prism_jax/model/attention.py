"""Causal self-attention for every architecture, with its key/value cache.

One attention core; the architectures differ only in how q, k and v are made:
- arch gpt2: one fused projection (D, 3, H, Dh), q | k | v, biases per model.bias; learned
  positions were added to the input (model/transformer.py);
- arch llama: q (D, H, Dh) and k | v (D, 2, Hkv, Dh) with Hkv = model.n_kv_heads
  (grouped-query attention: query head h reads key/value head h // (H / Hkv), Llama's
  repeat_kv), optional q/k/v biases (Qwen2), rotary positions on q and k (model/rope.py)
  before they enter the cache; no output bias.
The cache holds keys and values of the Hkv heads, (B, S, Hkv, Dh), S = max_len.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from prism_jax.config import ModelConfig
from prism_jax.model import rope
from prism_jax.model.ops import bias_value, dropout, matmul, wide
from prism_jax.model.params import const_param, normal_param
from prism_jax.model.tap import Tap, linear


class KVCache(NamedTuple):
  """Per-layer key/value cache for decoding: (B, S, Hkv, Dh) each, S = max_len."""

  k_BxSxHxDh: jax.Array
  v_BxSxHxDh: jax.Array


def _project(x_BxTxD: jax.Array, kernel: nnx.Param, dtype) -> jax.Array:
  """x @ kernel over D, the kernel's other axes kept: (B, T, ...)."""
  w = kernel[...].astype(dtype)
  return matmul(x_BxTxD, w.reshape(w.shape[0], -1)).reshape(x_BxTxD.shape[:2] + w.shape[1:])


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, hkv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    self.cfg = cfg
    std = cfg.init_std
    if cfg.arch == "gpt2":
      self.qkv_kernel = normal_param(rngs, (d, 3, h, dh), std, ("embed", None, "heads", "kv"))
      self.qkv_bias = const_param((3, h, dh), 0.0, (None, "heads", "kv")) if cfg.bias else None
    else:
      self.q_kernel = normal_param(rngs, (d, h, dh), std, ("embed", "heads", "kv"))
      self.kv_kernel = normal_param(rngs, (d, 2, hkv, dh), std, ("embed", None, "heads", "kv"))
      self.q_bias = const_param((h, dh), 0.0, ("heads", "kv")) if cfg.qkv_bias else None
      self.kv_bias = (const_param((2, hkv, dh), 0.0, (None, "heads", "kv"))
                      if cfg.qkv_bias else None)
    proj_std = std / (2 * cfg.n_layers) ** 0.5  # GPT-2 residual scaling
    self.out_kernel = normal_param(rngs, (h, dh, d), proj_std, ("heads", "kv", "embed"))
    self.out_bias = const_param((d,), 0.0, ("embed",)) if cfg.bias else None

  def qkv(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, tap: Tap | None):
    """q (B, T, H, Dh), k and v (B, T, Hkv, Dh), positions applied."""
    dtype = x_BxTxD.dtype
    if self.cfg.arch == "gpt2":
      qkv = _project(x_BxTxD, self.qkv_kernel, dtype) + bias_value(self.qkv_bias, dtype)
      qkv = linear(tap, "qkv", x_BxTxD, qkv, bias=self.cfg.bias)
      return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    has_bias = self.cfg.qkv_bias
    q = _project(x_BxTxD, self.q_kernel, dtype) + bias_value(self.q_bias, dtype)
    q = linear(tap, "q", x_BxTxD, q, bias=has_bias)
    kv = _project(x_BxTxD, self.kv_kernel, dtype) + bias_value(self.kv_bias, dtype)
    kv = linear(tap, "kv", x_BxTxD, kv, bias=has_bias)
    return (rope.rotate(q, positions_BxT, self.cfg), rope.rotate(kv[:, :, 0], positions_BxT,
                                                                  self.cfg), kv[:, :, 1])

  def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array,
               cache: KVCache | None = None, tap: Tap | None = None,
               dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    dtype = x_BxTxD.dtype
    q_BxTxHxDh, k_BxTxGxDh, v_BxTxGxDh = self.qkv(x_BxTxD, positions_BxT, tap)
    if cache is None:
      keys, values = k_BxTxGxDh, v_BxTxGxDh
      key_pos_BxS = positions_BxT
    else:
      # Write this chunk at its positions; attend over the whole (masked) cache.
      b_idx = jnp.arange(x_BxTxD.shape[0])[:, None]
      keys = cache.k_BxSxHxDh.at[b_idx, positions_BxT].set(k_BxTxGxDh.astype(
          cache.k_BxSxHxDh.dtype))
      values = cache.v_BxSxHxDh.at[b_idx, positions_BxT].set(v_BxTxGxDh.astype(
          cache.v_BxSxHxDh.dtype))
      cache = KVCache(keys, values)
      key_pos_BxS = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
      keys, values = keys.astype(dtype), values.astype(dtype)
    ctx_BxTxHxDh = self._attend(q_BxTxHxDh, keys, values, positions_BxT, key_pos_BxS,
                                dropout_key)
    w_HxDhxD = self.out_kernel[...].astype(dtype)
    out = matmul(ctx_BxTxHxDh.reshape(ctx_BxTxHxDh.shape[:2] + (-1,)),
                 w_HxDhxD.reshape(-1, w_HxDhxD.shape[-1]))
    out = linear(tap, "attn_out", ctx_BxTxHxDh, out + bias_value(self.out_bias, dtype),
                 bias=self.cfg.bias)
    return out, cache

  def _attend(self, q_BxTxHxDh, keys_BxSxGxDh, values_BxSxGxDh, positions_BxT, key_pos_BxS,
              dropout_key):
    """softmax(q kᵀ / √Dh, causal) v, each query head reading its group's key/value head."""
    dtype = q_BxTxHxDh.dtype
    batch, seq, heads, dh = q_BxTxHxDh.shape
    groups = keys_BxSxGxDh.shape[2]
    # Full multi-head attention (GPT-2, or n_kv_heads = n_heads) without the group axis: the
    # program GPT-2 has always lowered to (the scale table's compile cache keys on it).
    spec = ("bthk,bshk->bhts", "bhts,bshk->bthk") if groups == heads else (
        "btgrk,bsgk->bgrts", "bgrts,bsgk->btgrk")
    q = q_BxTxHxDh if groups == heads else q_BxTxHxDh.reshape(batch, seq, groups,
                                                              heads // groups, dh)
    sdt = wide(dtype)
    scores = jnp.einsum(spec[0], q, keys_BxSxGxDh).astype(sdt)
    scores = scores / jnp.sqrt(jnp.asarray(dh, sdt))
    causal_BxTxS = positions_BxT[:, :, None] >= key_pos_BxS[:, None, :]
    causal = causal_BxTxS[:, None] if groups == heads else causal_BxTxS[:, None, None]
    scores = jnp.where(causal, scores, jnp.finfo(sdt).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    probs = dropout(probs, self.cfg.dropout, dropout_key)
    return jnp.einsum(spec[1], probs, values_BxSxGxDh).reshape(batch, seq, heads, dh)
