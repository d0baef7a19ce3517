"""AdamW with linear warm-up + cosine decay, global-norm clipping and a weight-decay mask.

No weight decay on (PRISM.md §2 and GPT-2 practice):
  * the prototype bank `bank.protos`: prototypes must stay on the data manifold (R1/R2
    pull them to real hidden states); decay would drag them towards the origin;
  * LayerNorm scales/biases and every bias: shrinking them changes the function without
    reducing capacity; likewise the learned mixture scale `mix_log_scale` (a scalar gain).
Embeddings (`wte`, `wpe`) ARE decayed: `wte` is also the tied LM head (a matmul weight
whose scale sets the logit scale), and nanoGPT/GPT-2 decay both embeddings; the decay
keeps the logit norm in check without touching the prototypes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from prism_jax.config import TrainConfig

PROTO_PATH = ("bank", "protos")


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  """0 -> lr linearly over warmup_steps, then cosine to lr * min_lr_ratio at `steps`."""
  warmup = min(cfg.warmup_steps, cfg.steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
      decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def _key_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
               for k in path)


def decays(path) -> bool:
  """True where weight decay applies, given a parameter's tree path."""
  names = _key_names(path)
  if names[-len(PROTO_PATH):] == PROTO_PATH:
    return False
  last = names[-1]
  parent = names[-2] if len(names) > 1 else ""
  is_norm = parent.startswith("ln") and last in ("scale", "bias")
  return not (is_norm or last == "bias" or last.endswith("_bias") or last == "mix_log_scale")


def decay_mask(params: Any) -> Any:
  """Pytree of bools (like `params`): True = weight decay applies."""
  return jax.tree_util.tree_map_with_path(lambda p, _: decays(p), params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW (decay masked) on the warm-up + cosine schedule.
  `trainable="prototypes"`: the same on the head's parameters alone (clipped by their own
  norm); every other update is exactly zero (no weight decay either)."""
  tx = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=1e-8,
                  weight_decay=cfg.weight_decay, mask=decay_mask))
  return tx if cfg.trainable == "all" else only_head(tx)


def only_head(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` on the head's parameters alone: the backbone's gradients are zeroed before it (so
  clipping sees the head's norm) and its updates after it (so weight decay cannot move
  it). The state keeps the full tree's shape, so shardings and checkpoints are unchanged."""
  def keep(tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if is_head(p) else jnp.zeros_like(x), tree)

  def update(updates, state, params=None):
    updates, state = tx.update(keep(updates), state, params)
    return keep(updates), state

  return optax.GradientTransformation(tx.init, update)


def is_head(path) -> bool:
  """Whether a parameter (tree path) belongs to the prototype head, not the backbone."""
  return _key_names(path)[0] != "backbone"


def reset_moments(opt_state: Any, path: tuple[str, ...] = PROTO_PATH, rows=None) -> Any:
  """Zero every optimiser leaf that mirrors the parameter at `path` (Adam mu/nu), or only
  its `rows` (revived prototypes).

  Used when prototypes are re-initialised from data: moments accumulated for the old bank
  would push the new one. Adam's shared step count is kept, so the first updates after the
  reset are smaller than usual (a built-in mini warm-up for the new bank).
  """
  def one(p, x):
    if _key_names(p)[-len(path):] != path:
      return x
    return jnp.zeros_like(x) if rows is None else x.at[jnp.asarray(rows)].set(0)
  return jax.tree_util.tree_map_with_path(one, opt_state)
