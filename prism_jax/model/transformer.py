"""GPT-2-style pre-LN decoder backbone in flax NNX.

Every parameter carries logical axis names from birth (`out_sharding=`); the mesh rules that
map them to devices live in one table elsewhere. Modules hold no shared references, so they
work in NNX tree mode.

Dtypes: the blocks compute in `cfg.dtype`; LayerNorm statistics, attention scores and the
logits in at least float32 (`wide`). A model whose parameters were cast to float64 (EK-FAC's
float64 references under jax.enable_x64) computes in float64 throughout; float32/bf16 runs
are unchanged by that rule. An optional `Tap` (model/tap.py) captures every linear map's
input and output-gradient for attribution.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.topk_reconstruct.cpu import SCOPE as CPU_SCOPE
from prism_jax.config import ModelConfig
from prism_jax.model.params import const_param as _const
from prism_jax.model.params import normal_param as _param
from prism_jax.model.tap import Tap, linear, scoped
from prism_jax.sharding import constrain


# The logit of a padding row of the vocabulary (model.vocab_used): never predicted, yet
# finite, so that means and variances over the vocabulary stay finite.
PAD_LOGIT = -1e9


def wide(dtype) -> jnp.dtype:
  """At least float32: float32 for bf16/fp32 compute, float64 for float64 references."""
  return jnp.promote_types(dtype, jnp.float32)


def compute_dtype(cfg: ModelConfig, param: jax.Array) -> jnp.dtype:
  """cfg.dtype, or float64 when the parameters are float64 (reference runs)."""
  return jnp.dtype(jnp.float64) if param.dtype == jnp.float64 else jnp.dtype(cfg.dtype)


def tied_logits(h_BxTxD: jax.Array, wte_VxD: jax.Array, dtype: str,
                num_token_ids: int | None = None) -> jax.Array:
  """The tied LM head as a function of W: logits = h W^T in (at least) fp32. Full fp32
  accuracy when `dtype` (ModelConfig.dtype) is float32, so the logit decomposition is
  exact; default (fast) matmul precision when the model computes in bf16 anyway. Rows at
  and past `num_token_ids` (ModelConfig.num_token_ids: vocabulary padding) get PAD_LOGIT:
  never predicted, and no gradient reaches them from the head."""
  precision = jax.lax.Precision.HIGHEST if dtype == "float32" else None
  logits = jnp.einsum("btd,vd->btv", h_BxTxD.astype(wide(h_BxTxD.dtype)), wte_VxD,
                      precision=precision)
  if num_token_ids is not None and num_token_ids < wte_VxD.shape[0]:
    vocab_iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    logits = jnp.where(vocab_iota < num_token_ids, logits,
                       jnp.asarray(PAD_LOGIT, logits.dtype))
  return constrain(logits, ("batch", "seq", "act_vocab"))


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout; the identity without a key (evaluation, generation) or at rate 0."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def _keys(key: jax.Array | None, n: int) -> tuple:
  return (None,) * n if key is None else tuple(jax.random.split(key, n))


def _bias(param, dtype):
  return 0.0 if param is None else param[...].astype(dtype)


def materialize(x: jax.Array) -> jax.Array:
  """The residual stream kept in memory at a sublayer boundary in a program compiled for
  CPU (a value no-op; other platforms' fusion is left alone).

  Without it XLA:CPU fuses the backward pass's running sum of residual-stream cotangents
  (every LayerNorm's backward terms, across layers) into each of its consumers, including
  the transposes of the weight gradients, and so recomputes that chain several times per
  layer (~20% of the dense CPU step at d 128; docs/history/RESULTS-to-2026-12-06.md "Training throughput").
  optimization_barrier has JVP and transpose rules, so the cotangent is materialised too.
  Chosen when the program is lowered (platform_dependent), not by the default backend."""
  return _on_cpu(jax.lax.optimization_barrier, _identity, x)


def _identity(x):
  return x


def _on_cpu(cpu_fn, default_fn, *args):
  """cpu_fn in a program compiled for CPU, default_fn elsewhere (the op's cpu.on_cpu)."""
  def cpu_scoped(*a):
    with jax.named_scope(CPU_SCOPE):
      return cpu_fn(*a)
  return jax.lax.platform_dependent(*args, cpu=cpu_scoped, default=default_fn)


def matmul(x_NxI: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """x @ w over the last axis of x. In a program compiled for CPU its weight gradient
  takes XLA:CPU's fast orientation (the values are those of autodiff's x^T g;
  tests/test_throughput.py); elsewhere it is plain autodiff of x @ w."""
  return _on_cpu(_matmul_cpu, _matmul, x_NxI, w_IxO)


def _matmul(x, w):
  return x @ w


@jax.custom_vjp
def _matmul_cpu(x, w):
  return x @ w


def _matmul_fwd(x, w):
  return x @ w, (x, w)


def _matmul_bwd(res, g):
  x, w = res
  x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
  # XLA:CPU's x^T g over the token axis runs ~2x slower when its output has more rows than
  # columns (the MLP's down-projection, d_mlp x d); computing (g^T x)^T behind a barrier (XLA
  # would fold the transpose back into the dot) keeps the fast one.
  if w.shape[0] > w.shape[1]:
    dw = jax.lax.optimization_barrier(g2.T @ x2).T
  else:
    dw = jax.lax.optimization_barrier(x2.T @ g2)
  return g @ w.T, dw


_matmul_cpu.defvjp(_matmul_fwd, _matmul_bwd)


class LayerNorm(nnx.Module):

  def __init__(self, d_model: int, bias: bool = True):
    self.scale = _const((d_model,), 1.0, ("norm",))
    self.bias = _const((d_model,), 0.0, ("norm",)) if bias else None

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(wide(x_BxTxD.dtype))  # statistics in fp32 whatever the compute dtype
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...] + _bias(self.bias, x.dtype)
    return y.astype(x_BxTxD.dtype)


class KVCache(NamedTuple):
  """Per-layer key/value cache for decoding: (B, S, H, Dh) each, S = max_len."""

  k_BxSxHxDh: jax.Array
  v_BxSxHxDh: jax.Array


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
    self.cfg = cfg
    self.qkv_kernel = _param(rngs, (d, 3, h, dh), cfg.init_std, ("embed", None, "heads", "kv"))
    self.qkv_bias = _const((3, h, dh), 0.0, (None, "heads", "kv")) if cfg.bias else None
    proj_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5  # GPT-2 residual scaling
    self.out_kernel = _param(rngs, (h, dh, d), proj_std, ("heads", "kv", "embed"))
    self.out_bias = _const((d,), 0.0, ("embed",)) if cfg.bias else None

  def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array,
               cache: KVCache | None = None, tap: Tap | None = None,
               dropout_key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    dtype, bias = x_BxTxD.dtype, self.cfg.bias
    w_Dx3xHxDh = self.qkv_kernel[...].astype(dtype)
    qkv = matmul(x_BxTxD, w_Dx3xHxDh.reshape(w_Dx3xHxDh.shape[0], -1)).reshape(
        x_BxTxD.shape[:2] + w_Dx3xHxDh.shape[1:])
    qkv = linear(tap, "qkv", x_BxTxD, qkv + _bias(self.qkv_bias, dtype), bias=bias)
    q_BxTxHxDh, k_BxTxHxDh, v_BxTxHxDh = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if cache is None:
      keys, values = k_BxTxHxDh, v_BxTxHxDh
      key_pos_BxS = positions_BxT
    else:
      # Write this chunk at its positions; attend over the whole (masked) cache.
      b_idx = jnp.arange(x_BxTxD.shape[0])[:, None]
      keys = cache.k_BxSxHxDh.at[b_idx, positions_BxT].set(k_BxTxHxDh.astype(
          cache.k_BxSxHxDh.dtype))
      values = cache.v_BxSxHxDh.at[b_idx, positions_BxT].set(v_BxTxHxDh.astype(
          cache.v_BxSxHxDh.dtype))
      cache = KVCache(keys, values)
      key_pos_BxS = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
      keys, values = keys.astype(dtype), values.astype(dtype)
    sdt = wide(dtype)
    scores = jnp.einsum("bthk,bshk->bhts", q_BxTxHxDh, keys).astype(sdt)
    scores = scores / jnp.sqrt(jnp.asarray(self.cfg.head_dim, sdt))
    causal_BxTxS = positions_BxT[:, :, None] >= key_pos_BxS[:, None, :]
    scores = jnp.where(causal_BxTxS[:, None], scores, jnp.finfo(sdt).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    probs = dropout(probs, self.cfg.dropout, dropout_key)
    ctx_BxTxHxDh = jnp.einsum("bhts,bshk->bthk", probs, values)
    w_HxDhxD = self.out_kernel[...].astype(dtype)
    out = matmul(ctx_BxTxHxDh.reshape(ctx_BxTxHxDh.shape[:2] + (-1,)),
                 w_HxDhxD.reshape(-1, w_HxDhxD.shape[-1]))
    out = linear(tap, "attn_out", ctx_BxTxHxDh, out + _bias(self.out_bias, dtype), bias=bias)
    return out, cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.d_mlp
    self.fc_kernel = _param(rngs, (d, f), cfg.init_std, ("embed", "mlp"))
    self.fc_bias = _const((f,), 0.0, ("mlp",)) if cfg.bias else None
    proj_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    self.proj_kernel = _param(rngs, (f, d), proj_std, ("mlp", "embed"))
    self.proj_bias = _const((d,), 0.0, ("embed",)) if cfg.bias else None
    self.bias = cfg.bias

  def __call__(self, x_BxTxD: jax.Array, tap: Tap | None = None) -> jax.Array:
    dtype = x_BxTxD.dtype
    h = matmul(x_BxTxD, self.fc_kernel[...].astype(dtype)) + _bias(self.fc_bias, dtype)
    h = jax.nn.gelu(linear(tap, "mlp_fc", x_BxTxD, h, bias=self.bias), approximate=True)
    out = matmul(h, self.proj_kernel[...].astype(dtype)) + _bias(self.proj_bias, dtype)
    return linear(tap, "mlp_proj", h, out, bias=self.bias)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.ln1 = LayerNorm(cfg.d_model, cfg.bias)
    self.attn = Attention(cfg, rngs=rngs)
    self.ln2 = LayerNorm(cfg.d_model, cfg.bias)
    self.mlp = MLP(cfg, rngs=rngs)
    self.rate = cfg.dropout

  def __call__(self, x_BxTxD, positions_BxT, cache=None, tap: Tap | None = None,
               dropout_key: jax.Array | None = None):
    k_attn, k_res1, k_res2 = _keys(dropout_key, 3)
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
    self.wpe = _param(rngs, (cfg.max_len, cfg.d_model), cfg.init_std / 2, (None, "embed"))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.ln_f = LayerNorm(cfg.d_model, cfg.bias)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None,
               caches: list[KVCache] | None = None, tap: Tap | None = None,
               dropout_key: jax.Array | None = None):
    """z (B, T, D) after the final norm, and the updated caches (None without caches).
    `dropout_key` (training only) turns on model.dropout."""
    positions_BxT = self.positions(tokens_BxT, positions_BxT, caches)
    keys = _keys(dropout_key, self.cfg.n_layers + 1)
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
    x = self.wte[...][tokens_BxT] + self.wpe[...][positions_BxT]
    dtype = compute_dtype(self.cfg, self.wte[...])
    return constrain(x.astype(dtype), ("batch", "seq", "act_embed"))

  def final(self, x_BxTxD: jax.Array) -> jax.Array:
    """The final LayerNorm after the last block: z in (at least) float32."""
    z_BxTxD = self.ln_f(x_BxTxD)
    return constrain(z_BxTxD.astype(wide(z_BxTxD.dtype)), ("batch", "seq", "act_embed"))

  def lm_head(self, h_BxTxD: jax.Array) -> jax.Array:
    """Tied LM head W (V x D): logits = h W^T, in fp32."""
    return tied_logits(h_BxTxD, self.wte[...], self.cfg.dtype, self.cfg.num_token_ids)

  def init_cache(self, batch: int, dtype=jnp.float32) -> list[KVCache]:
    shape = (batch, self.cfg.max_len, self.cfg.n_heads, self.cfg.head_dim)
    return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(self.cfg.n_layers)]
