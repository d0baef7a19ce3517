"""Rotary position embeddings (arch=llama), as Llama, Qwen2 and Mistral compute them.

The head dim is split in two halves rotated against each other ("rotate_half", Hugging
Face's and Meta's layout after their q/k weight permutation), at the inverse frequencies
θ^(-2i/Dh); Llama 3's scaling divides the long wavelengths by a factor and interpolates the
middle band (ModelConfig.rope_scaling_factor and its three companions). The frequencies are
computed in float32 as transformers computes them, so imported logits match to rounding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """(Dh/2,) float32: the rotation speed of each pair of the head dim."""
  dh = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta)
                ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh)))).astype(np.float32)
  if not cfg.rope_scaling_factor:
    return inv
  factor, low, high = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                       cfg.rope_high_freq_factor)
  old_len = cfg.rope_original_max_len
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > old_len / low, inv / factor, inv)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rotate(x_BxTxHxDh: jax.Array, positions_BxT: jax.Array, cfg: ModelConfig) -> jax.Array:
  """x rotated by its token's position (queries and keys, before the cache)."""
  inv = jnp.asarray(inverse_frequencies(cfg))
  angle_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv
  angle = jnp.concatenate([angle_BxTxF, angle_BxTxF], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angle).astype(x_BxTxHxDh.dtype), jnp.sin(angle).astype(x_BxTxHxDh.dtype)
  half = x_BxTxHxDh.shape[-1] // 2
  rotated = jnp.concatenate([-x_BxTxHxDh[..., half:], x_BxTxHxDh[..., :half]], axis=-1)
  return x_BxTxHxDh * cos + rotated * sin
