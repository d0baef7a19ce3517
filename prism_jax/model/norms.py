"""The backbone's normalisations: GPT-2's LayerNorm and the Llama family's RMSNorm, both
with their statistics in at least float32 whatever the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from prism_jax.config import ModelConfig
from prism_jax.model.ops import bias_value, wide
from prism_jax.model.params import const_param


class LayerNorm(nnx.Module):

  def __init__(self, d_model: int, bias: bool = True, eps: float = 1e-5):
    self.scale = const_param((d_model,), 1.0, ("norm",))
    self.bias = const_param((d_model,), 0.0, ("norm",)) if bias else None
    self.eps = eps

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(wide(x_BxTxD.dtype))
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + bias_value(self.bias,
                                                                                 x.dtype)
    return y.astype(x_BxTxD.dtype)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, no centring and no bias (Llama, Qwen2, Mistral): as transformers
  computes it, the normalised x is cast back to the compute dtype before the scale."""

  def __init__(self, d_model: int, eps: float = 1e-5):
    self.scale = const_param((d_model,), 1.0, ("norm",))
    self.eps = eps

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(wide(x_BxTxD.dtype))
    y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x_BxTxD.dtype) * y.astype(x_BxTxD.dtype)


def make_norm(cfg: ModelConfig) -> LayerNorm | RMSNorm:
  """The architecture's normalisation over d_model."""
  if cfg.arch == "llama":
    return RMSNorm(cfg.d_model, cfg.norm_eps)
  return LayerNorm(cfg.d_model, cfg.bias, cfg.norm_eps)
