"""PRISM's training recipe in one place: `Recipe(cfg, mesh)`.

What a PRISM run does besides taking optimiser steps, built once per (config, mesh):
  - the optimiser, the model template (graphdef) and the state's shardings;
  - the initial state (born sharded) and the abstract state (the restore target);
  - the jitted step of each phase: the dense warm-up (CE through W z) until
    `train.proto_init_step`, then PRISM's loss (`train.trainable=prototypes`: on the head
    alone, the backbone frozen from the bank's setting on); gradient accumulation (`train.grad_accum`)
    lives inside the step (prism_jax/train/accumulate.py);
  - what runs before a step: at `train.proto_init_step` the bank is set from hidden states
    by k-means++ (PRISM.md §3) with the bank's Adam moments reset ("auto": at the first
    eval step where those states no longer share one direction, or at
    `train.proto_init_latest`); every
    `train.revive_every` steps the prototypes no token selected are set anew
    (prism_jax/train/revive.py).
`train()` (train/run.py: data, checkpoints, evaluation, the loop) and the LDS retrains
(attribution/quality/retrain.py: the same recipe on a subset of rows) both run it: a change to the
recipe made here changes both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np
from absl import logging
from flax import nnx

from prism_jax import grounding
from prism_jax.config import Config, latest_proto_init
from prism_jax.model.lm import init_prototypes_from_hidden
from prism_jax.train import revive
from prism_jax.train import step as step_lib
from prism_jax.train.optimizer import PROTO_PATH, make_optimizer, reset_moments
from prism_jax.train.state import TrainState, init_fn, model_template, state_shardings


class Recipe:
  """The recipe of `cfg` on `mesh` (module docstring). `source` arguments are batch
  sources with `global_batch_at(step)` (the training loader, or a retrain's subset)."""

  def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
    self.cfg, self.mesh = cfg, mesh
    self.tx = make_optimizer(cfg.train)
    # trainable=prototypes freezes the backbone once the bank is set; the dense warm-up before
    # it (proto_init_step > 0) trains the backbone, through the same optimiser state's shape.
    self._dense_tx = (self.tx if cfg.train.trainable == "all" else
                      make_optimizer(dataclasses.replace(cfg.train, trainable="all")))
    template = model_template(cfg.model)
    self.graphdef = template[0]
    self.shardings = state_shardings(cfg, mesh, self.tx, template)
    self._warm_dense = step_lib.uses_dense_warmup(cfg)
    self._steps: dict[bool, Callable] = {}
    data_init = cfg.model.kind == "prism" and cfg.model.proto_init == "data"
    self.auto_init = cfg.train.proto_init_step == "auto" and data_init
    # The step the bank was set from data at (None: not yet). With "auto" it is found while
    # training and kept in each checkpoint's data item (with_bank_state / restore_bank_state);
    # without an init from data, "auto" has nothing to wait for (0).
    self.bank_set_at: int | None = cfg.train.proto_init_step
    if cfg.train.proto_init_step == "auto":
      self.bank_set_at = None if self.auto_init else 0

  def init_state(self) -> TrainState:
    """The initial state, a pure function of train.seed, born sharded."""
    return jax.jit(init_fn(self.cfg, self.tx), out_shardings=self.shardings)()

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs carrying the shardings: what a checkpoint is restored into."""
    shapes = jax.eval_shape(init_fn(self.cfg, self.tx))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, self.shardings)

  def step_for(self, step: int) -> Callable:
    """The jitted step for `step` (compiled once per phase)."""
    dense = self._warm_dense and (self.bank_set_at is None or step < self.bank_set_at)
    if dense not in self._steps:
      tx = self._dense_tx if dense else self.tx
      self._steps[dense] = step_lib.make_train_step(self.graphdef, self.cfg, tx,
                                                    self.shardings, self.mesh,
                                                    dense_phase=dense)
    return self._steps[dense]

  def due(self, step: int) -> bool:
    """Whether `before_step(step, ...)` changes anything (the loop pauses its clock)."""
    return (revive.revive_due(self.cfg, step, self.bank_set_at)
            or self._init_check_due(step))

  def _init_check_due(self, step: int) -> bool:
    if not self.auto_init:
      return proto_init_due(self.cfg, step)
    tc = self.cfg.train
    return self.bank_set_at is None and (
        (step > 0 and step % tc.eval_every == 0) or step >= latest_proto_init(tc))

  def with_bank_state(self, data_state: dict) -> dict:
    """The data state to checkpoint, with the step "auto" set the bank at (if it has)."""
    if not self.auto_init or self.bank_set_at is None:
      return data_state
    return {**data_state, BANK_SET_AT: self.bank_set_at}

  def restore_bank_state(self, data_state: dict) -> dict:
    """A restored data state without the bank's step, which this recipe takes back."""
    data_state = dict(data_state)
    at = data_state.pop(BANK_SET_AT, None)
    if self.auto_init:
      self.bank_set_at = None if at is None else int(at)
    return data_state

  def before_step(self, step: int, state: TrainState, source) -> tuple[TrainState, str]:
    """(state, note): revival or the bank's init when due at `step` ('' note: nothing)."""
    cfg = self.cfg
    if revive.revive_due(cfg, step, self.bank_set_at):
      toks, mask = revive.window_tokens(source, cfg, step)
      state, n, seen = revive.revive_dead(self.graphdef, state, self.shardings, cfg, toks,
                                          mask)
      return state, (f"step {step}: revived {n} prototypes no token of {seen} selected"
                     if n else "")
    if not self._init_check_due(step):
      return state, ""
    toks, mask = proto_init_tokens(source, cfg, step)
    why, z_BxTxD = "", None
    if self.auto_init:  # the states the bank would be set from decide whether it is now
      z_BxTxD = _hidden_states(self.graphdef, state, self.shardings, toks)
      cos = _common_cos(z_BxTxD, mask)
      latest = latest_proto_init(cfg.train)
      if cos >= cfg.train.proto_init_cos and step < latest:
        return state, (f"step {step}: bank not set yet (proto_init_step=auto: the hidden "
                       f"states' mean cosine to their mean direction {cos:.2f} >= "
                       f"{cfg.train.proto_init_cos:g}; set at step {latest} at the latest)")
      why = (f"; auto: cosine {cos:.2f} < {cfg.train.proto_init_cos:g}"
             if cos < cfg.train.proto_init_cos else
             f"; auto: the latest step {latest} reached, cosine {cos:.2f}")
    state, cos = _init_prototypes(self.graphdef, state, self.shardings, cfg, toks, mask,
                                  z_BxTxD)
    self.bank_set_at = step
    warning = grounding.shared_direction_warning(cos)
    if warning:
      logging.warning("step %d: %s", step, warning)
    return state, (f"step {step}: prototypes set from {int(mask.sum())} hidden states "
                   f"({cfg.model.proto_init_pick}; mean cosine to their mean direction "
                   f"{cos:.2f}{why})")


BANK_SET_AT = "proto_init_at"  # the data item's key of the step "auto" set the bank at


def _common_cos(z_BxTxD: np.ndarray, mask_BxT: np.ndarray) -> float:
  """The mean cosine of the valid tokens' hidden states to their mean direction."""
  valid = np.asarray(mask_BxT, bool).reshape(-1)
  return grounding.common_direction_cos(z_BxTxD.reshape(-1, z_BxTxD.shape[-1])[valid])


@functools.lru_cache(maxsize=8)
def _hidden_fn(graphdef, mesh):
  """The backbone's forward, jitted once per (model, mesh) (an "auto" init checks at every
  eval step until it sets the bank), with a replicated result: on several processes the
  parameters span devices this process cannot read, and every process must pick the same
  prototypes."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(lambda params, tokens: nnx.merge(graphdef, params).backbone(tokens)[0],
                 out_shardings=replicated)


def _hidden_states(graphdef, state: TrainState, shardings: TrainState,
                   tokens_BxT: np.ndarray) -> np.ndarray:
  return np.asarray(_hidden_fn(graphdef, shardings.step.mesh)(state.params, tokens_BxT))


def proto_init_due(cfg: Config, step: int) -> bool:
  return (cfg.model.kind == "prism" and cfg.model.proto_init == "data"
          and step == cfg.train.proto_init_step)


def init_prototypes(graphdef, state: TrainState, shardings: TrainState, cfg: Config,
                    tokens_BxT: np.ndarray, mask_BxT: np.ndarray) -> TrainState:
  """Bank <- hidden states of the given tokens (k-means++), Adam moments of the bank reset.

  Deterministic in (train.seed, state.step) and the parameters, so a resume reproduces it.
  """
  return _init_prototypes(graphdef, state, shardings, cfg, tokens_BxT, mask_BxT)[0]


def _init_prototypes(graphdef, state: TrainState, shardings: TrainState, cfg: Config,
                     tokens_BxT: np.ndarray, mask_BxT: np.ndarray,
                     z_BxTxD: np.ndarray | None = None) -> tuple[TrainState, float]:
  """(init_prototypes' state, the states' mean cosine to their mean direction);
  `z_BxTxD`: the tokens' hidden states when the caller has them already."""
  step = int(jax.device_get(state.step))
  seed = int(np.random.SeedSequence([cfg.train.seed, step]).generate_state(1)[0])
  module = nnx.merge(graphdef, state.params)
  if z_BxTxD is None:
    z_BxTxD = _hidden_states(graphdef, state, shardings, tokens_BxT)
  chosen = init_prototypes_from_hidden(module, tokens_BxT, seed=seed, mask_BxT=mask_BxT,
                                       kmeans_pp=cfg.model.proto_init_pick == "kmeans++",
                                       z_BxTxD=z_BxTxD)
  # the bank's value from the host copy (the same float32 values the module got): under
  # FSDP over several processes the module's bank spans devices this process cannot read
  protos = np.asarray(z_BxTxD, np.float64).reshape(-1, z_BxTxD.shape[-1])[chosen]
  protos = protos.astype(np.float32)
  params = jax.tree.map(lambda x: x, state.params)
  params[PROTO_PATH[0]][PROTO_PATH[1]] = jax.device_put(
      protos, shardings.params[PROTO_PATH[0]][PROTO_PATH[1]])
  opt_state = jax.device_put(reset_moments(state.opt_state), shardings.opt_state)
  return TrainState(state.step, params, opt_state), _common_cos(z_BxTxD, mask_BxT)


def proto_init_tokens(loader, cfg: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
  """Global batches step, step+1, ... until there are >= 2K valid tokens (every process
  reads the same global rows so all processes pick the same prototypes)."""
  need = 2 * cfg.model.num_prototypes
  toks, masks, s = [], [], step
  while sum(int(m.sum()) for m in masks) < need and len(toks) < 64:
    b = loader.global_batch_at(s)
    toks.append(b["inputs"])
    masks.append(b["mask"])
    s += 1
  return np.concatenate(toks), np.concatenate(masks)
