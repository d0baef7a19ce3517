"""The backbone's primitives, shared by every architecture (model/transformer.py,
model/attention.py): dtypes, the tied or untied LM head's logits, dropout, and the two
CPU-only program choices (the residual stream materialised at sublayer boundaries, the
weight gradient's fast orientation), taken when the program is lowered
(`jax.lax.platform_dependent`), never from the default backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.topk_reconstruct.cpu import SCOPE as CPU_SCOPE
from prism_jax.config import ModelConfig
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


def split_keys(key: jax.Array | None, n: int) -> tuple:
  return (None,) * n if key is None else tuple(jax.random.split(key, n))


def bias_value(param, dtype):
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
