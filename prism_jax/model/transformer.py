"""The decoder backbone in flax NNX: GPT-2's (pre-LN, learned positions, GELU MLP, tied
head) or the Llama family's (pre-RMSNorm, rotary positions, SwiGLU MLP, grouped-query
attention, tied or untied head), chosen by model.arch. One Block and one Backbone serve
both; the parts that differ are the norm (model/norms.py), how attention makes q, k, v
(model/attention.py) and the MLP's gate.

Every parameter carries logical axis names from birth (`out_sharding=`); the mesh rules that
map them to devices live in one table elsewhere. Modules hold no shared references, so they
work in NNX tree mode.

Dtypes: the blocks compute in `cfg.dtype`; norm statistics, attention scores and the
logits in at least float32 (`wide`). A model whose parameters were cast to float64 (EK-FAC's
float64 references under jax.enable_x64) computes in float64 throughout; float32/bf16 runs
are unchanged by that rule. An optional `Tap` (model/tap.py) captures every linear map's
input and output-gradient for attribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from prism_jax.config import ModelConfig
from prism_jax.model.attention import Attention, KVCache
from prism_jax.model.norms import make_norm
from prism_jax.model.ops import (bias_value, compute_dtype, dropout, materialize, matmul,
                                 split_keys, tied_logits, wide)
from prism_jax.model.params import const_param as _const
from prism_jax.model.params import normal_param as _param
from prism_jax.model.tap import Tap, linear, scoped
from prism_jax.sharding import constrain

__all__ = ["Attention", "Backbone", "Block", "KVCache", "MLP"]


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.d_mlp
    self.fc_kernel = _param(rngs, (d, f), cfg.init_std, ("embed", "mlp"))
    self.fc_bias = _const((f,), 0.0, ("mlp",)) if cfg.bias else None
    proj_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    self.proj_kernel = _param(rngs, (f, d), proj_std, ("mlp", "embed"))
    self.proj_bias = _const((d,), 0.0, ("embed",)) if cfg.bias else None
    # SwiGLU (arch llama): silu(x W_gate) * (x W_fc), then W_proj (Llama's gate/up/down).
    self.gate_kernel = (_param(rngs, (d, f), cfg.init_std, ("embed", "mlp"))
                        if cfg.arch == "llama" else None)
    self.bias = cfg.bias

  def __call__(self, x_BxTxD: jax.Array, tap: Tap | None = None) -> jax.Array:
    dtype = x_BxTxD.dtype
    h = matmul(x_BxTxD, self.fc_kernel[...].astype(dtype)) + bias_value(self.fc_bias, dtype)
    h = linear(tap, "mlp_fc", x_BxTxD, h, bias=self.bias)
    if self.gate_kernel is None:
      h = jax.nn.gelu(h, approximate=True)
    else:
      gate = linear(tap, "mlp_gate", x_BxTxD,
                    matmul(x_BxTxD, self.gate_kernel[...].astype(dtype)), bias=False)
      h = jax.nn.silu(gate) * h
    out = matmul(h, self.proj_kernel[...].astype(dtype)) + bias_value(self.proj_bias, dtype)
    return linear(tap, "mlp_proj", h, out, bias=self.bias)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.ln1 = make_norm(cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.ln2 = make_norm(cfg)
    self.mlp = MLP(cfg, rngs=rngs)
    self.rate = cfg.dropout

  def __call__(self, x_BxTxD, positions_BxT, cache=None, tap: Tap | None = None,
               dropout_key: jax.Array | None = None):
    k_attn, k_res1, k_res2 = split_keys(dropout_key, 3)
    x_BxTxD = materialize(x_BxTxD)
    attn_out, cache = self.attn(self.ln1(x_BxTxD), positions_BxT, cache, tap, k_attn)
    x_BxTxD = materialize(x_BxTxD + dropout(attn_out, self.rate, k_res1))
    x_BxTxD = x_BxTxD + dropout(self.mlp(self.ln2(x_BxTxD), tap), self.rate, k_res2)
    return x_BxTxD, cache


class Backbone(nnx.Module):
  """Token + position embeddings, L pre-LN blocks, final LayerNorm -> z (B, T, D)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wte = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"))
    self.wpe = (_param(rngs, (cfg.max_len, cfg.d_model), cfg.init_std / 2, (None, "embed"))
                if cfg.arch == "gpt2" else None)  # llama: rotary positions in attention
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.ln_f = make_norm(cfg)
    # The LM head W (V x D): the token embedding (tied) or its own matrix.
    self.unembed = (None if cfg.tie_embeddings else
                    _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed")))

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None,
               caches: list[KVCache] | None = None, tap: Tap | None = None,
               dropout_key: jax.Array | None = None):
    """z (B, T, D) after the final norm, and the updated caches (None without caches).
    `dropout_key` (training only) turns on model.dropout."""
    positions_BxT = self.positions(tokens_BxT, positions_BxT, caches)
    keys = split_keys(dropout_key, self.cfg.n_layers + 1)
    x = dropout(self.embed(tokens_BxT, positions_BxT), self.cfg.dropout, keys[0])
    new_caches = []
    for i, block in enumerate(self.blocks):
      cache = None if caches is None else caches[i]
      if self.cfg.remat and caches is None and tap is None:
        x, cache = nnx.remat(lambda blk, h, pos, key: blk(h, pos, dropout_key=key))(
            block, x, positions_BxT, keys[i + 1])
      else:
        x, cache = block(x, positions_BxT, cache, scoped(tap, f"block{i}"), keys[i + 1])
        if tap is not None:
          tap.stream(f"block{i}", x)
      new_caches.append(cache)
    z_BxTxD = self.final(x)
    if tap is not None:
      tap.stream("z", z_BxTxD)
    return z_BxTxD, (None if caches is None else new_caches)

  def positions(self, tokens_BxT, positions_BxT=None, caches=None) -> jax.Array:
    """The given positions, or 0..T-1 per row; checks T against max_len without a cache."""
    batch, seq = tokens_BxT.shape
    if caches is None and seq > self.cfg.max_len:
      raise ValueError(f"sequence length {seq} exceeds model.max_len={self.cfg.max_len}")
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    return positions_BxT

  def embed(self, tokens_BxT: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """Token + position embeddings in the compute dtype: the first block's input."""
    x = self.wte[...][tokens_BxT]
    if self.wpe is not None:
      x = x + self.wpe[...][positions_BxT]
    dtype = compute_dtype(self.cfg, self.wte[...])
    return constrain(x.astype(dtype), ("batch", "seq", "act_embed"))

  def final(self, x_BxTxD: jax.Array) -> jax.Array:
    """The final LayerNorm after the last block: z in (at least) float32."""
    z_BxTxD = self.ln_f(x_BxTxD)
    return constrain(z_BxTxD.astype(wide(z_BxTxD.dtype)), ("batch", "seq", "act_embed"))

  def unembedding(self) -> jax.Array:
    """The LM head's matrix W (V x D): the token embedding when tied, else its own. Every
    reader of W (the PRISM head, decompositions, curvature) takes it from here."""
    return (self.wte if self.unembed is None else self.unembed)[...]

  def lm_head(self, h_BxTxD: jax.Array) -> jax.Array:
    """The LM head W (V x D): logits = h W^T, in fp32."""
    return tied_logits(h_BxTxD, self.unembedding(), self.cfg.dtype, self.cfg.num_token_ids)

  def init_cache(self, batch: int, dtype=jnp.float32) -> list[KVCache]:
    shape = (batch, self.cfg.max_len, self.cfg.kv_heads, self.cfg.head_dim)
    return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(self.cfg.n_layers)]
