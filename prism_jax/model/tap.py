"""Capture of per-layer inputs and output-gradients from the real model (no hooks, no copy).

A `Tap` passed down the forward pass (`PrismLM(..., tap=tap)`, `Block(..., tap=tap)`) adds a
zero "probe" to the output of every linear map named in `tap.probes` and records that map's
input. The gradient of a loss w.r.t. the probes is the per-token output-gradient δ of each
layer, so a layer's weight gradient is Σ_t δ_t a_tᵀ with a the recorded input (a 1 appended
where the layer has a bias). EK-FAC (attribution/hessians/ekfac_capture.py) is built on this.

Names are "block{i}.{qkv|attn_out|mlp_fc|mlp_proj}" and "bank" (the prototype bank as the
linear map ẑ = Pᵀ a, a ∈ R^K held fixed); probes are (B, T, out), inputs come back as
(B, T, in). `streams` names residual-stream values to keep: "block{i}" is the stream after
block i (B, T, D), "z" the final hidden state; they come back in `tap.inputs` too.
Without a tap, or for names not probed, the forward is unchanged bit for bit. The
recorded values are traced: return `tap.inputs` from the function being traced.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

BLOCK_LAYERS = ("qkv", "attn_out", "mlp_fc", "mlp_proj")


class Tap:
  """Probes in, layer inputs out (see module docstring). `scope` prefixes names."""

  def __init__(self, probes: Mapping[str, jax.Array], prefix: str = "",
               inputs: dict[str, jax.Array] | None = None, streams: tuple[str, ...] = ()):
    self.probes = probes
    self.prefix = prefix
    self.inputs = {} if inputs is None else inputs
    self.streams = streams

  def scope(self, name: str) -> "Tap":
    """A view of the same tap whose names are `name.<layer>`."""
    return Tap(self.probes, f"{self.prefix}{name}.", self.inputs, self.streams)

  def stream(self, name: str, x: jax.Array) -> None:
    """Keeps a residual-stream value if its name is in `streams`."""
    if self.prefix + name in self.streams:
      self.inputs[self.prefix + name] = x

  def linear(self, name: str, x_in: jax.Array, y_out: jax.Array, *, bias: bool = True):
    """y_out + probe (reshaped to y's shape), recording x_in as (B, T, in[+1])."""
    key = self.prefix + name
    probe = self.probes.get(key)
    if probe is None:
      return y_out
    if probe.size != y_out.size:
      raise ValueError(f"probe {key!r} has shape {probe.shape}; the layer's output is "
                       f"{y_out.shape} (probes are (B, T, out))")
    x = x_in.reshape(probe.shape[:2] + (-1,))
    if bias:
      x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], -1)
    self.inputs[key] = x
    return y_out + probe.reshape(y_out.shape).astype(y_out.dtype)


def scoped(tap: Tap | None, name: str) -> Tap | None:
  return None if tap is None else tap.scope(name)


def linear(tap: Tap | None, name: str, x_in, y_out, *, bias: bool = True):
  """`tap.linear` that is the identity without a tap."""
  return y_out if tap is None else tap.linear(name, x_in, y_out, bias=bias)
