"""Gradient accumulation: one update from M microbatches, equal to the whole batch's.

A global batch of B rows too large for the devices' memory is taken as M microbatches of
B/M rows; their gradients are summed inside the one jitted step (a `lax.scan`, so memory
holds one microbatch's activations) and the optimiser updates once.

Rows go to microbatches strided, row r to microbatch r mod M: a device holding a
contiguous block of B/dp rows (dp = data x fsdp) gives each microbatch B/(dp M) of its own
rows, so no row moves between devices (B must be divisible by dp x M).

The contract with the loss. With `prepass=None` every microbatch's loss is weighted 1/M:
exact for a loss that is a mean over equally many examples. A loss with token masks or
terms that are not means over tokens (PRISM's R1 = mean over prototypes of a minimum over
the *whole* batch's tokens) passes `prepass(params, microbatches, *extra) -> contexts`
(a pytree with a leading M axis) and takes `ctx` as its last argument: it returns its
microbatch's *share*, the shares summing to the whole batch's loss (and metrics).
prism_jax/train/step.py's PRISM prepass gives each microbatch its share of the valid
tokens and the prototypes whose nearest token of the whole batch lies in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def split(batch: Any, num: int) -> Any:
  """Every (B, ...) leaf as (num, B/num, ...), microbatch m holding rows m, m+num, ..."""
  def one(x):
    if x.shape[0] % num:
      raise ValueError(f"a batch of {x.shape[0]} rows does not split into {num} microbatches")
    x = x.reshape((x.shape[0] // num, num) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(one, batch)


def value_and_grad(loss_fn: Callable, params: Any, batch: Any, extra: tuple, num: int,
                   prepass: Callable | None = None) -> tuple[tuple[jax.Array, dict], Any]:
  """((loss, metrics), grads) of the whole batch, summed over `num` microbatches."""
  micro = split(batch, num)
  if prepass is None:
    contexts, call = None, lambda p, mb, ctx: _scaled(loss_fn(p, mb, *extra), 1.0 / num)
  else:
    contexts = prepass(params, micro, *extra)
    call = lambda p, mb, ctx: loss_fn(p, mb, *extra, ctx)
  grad_fn = jax.value_and_grad(call, has_aux=True)

  def body(carry, xs):
    mb, ctx = xs
    (loss, metrics), grads = grad_fn(params, mb, ctx)
    acc_loss, acc_metrics, acc_grads = carry
    return (acc_loss + loss, jax.tree.map(jnp.add, acc_metrics, metrics),
            jax.tree.map(jnp.add, acc_grads, grads)), None

  first = jax.tree.map(lambda x: x[0], micro)
  first_ctx = None if contexts is None else jax.tree.map(lambda x: x[0], contexts)
  shapes = jax.eval_shape(lambda p: call(p, first, first_ctx), params)
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
  init = (jnp.zeros((), jnp.float32), zeros(shapes[1]), zeros(params))
  (loss, metrics, grads), _ = jax.lax.scan(body, init, (micro, contexts))
  return (loss, metrics), grads


def _scaled(out, weight):
  loss, metrics = out
  return loss * weight, jax.tree.map(lambda m: m * weight, dict(metrics))
