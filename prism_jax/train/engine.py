"""The engine that runs steps for any loss: one step builder and one loop, used by the model's
training (`train()`, train/run.py), SAEs, controllers, probes and retrains.

    trainer = Trainer(loss_fn, optax.adam(1e-3), trainable=lambda path: path[0] == "probe")
    result = trainer.fit(params, batches, steps=100, workdir="runs/probe", ckpt_every=50)

`loss_fn(params, batch) -> (loss, metrics)` sees the whole parameter tree (a nested dict,
e.g. `nnx.to_pure_dict` of a model's Params beside a probe's weights). `trainable(path)`
(path = the tuple of dict keys down to a leaf) picks the leaves that get gradients and
optimiser state; the others pass through the step unchanged. `trainable=None` trains all.

The loop dispatches step s, then fetches step s-1's metrics (the host never waits for the
step it just launched); the NaN/Inf guard runs on what was fetched. Before a checkpoint
the step being saved is fetched and checked, so a non-finite state is never saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from prism_jax.train import accumulate
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax.train import metrics as metrics_lib
from prism_jax.train.tracking import parse_log_to
from prism_jax.train.progress import Progress
from prism_jax.train.state import TrainState

LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]
Trainable = Callable[[tuple[Any, ...]], bool]
StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]
Callback = Callable[[int, TrainState], None]


class TrainingDivergedError(FloatingPointError):
  """A step produced a non-finite loss or parameters; nothing after it was saved."""


def select(params: Mapping, trainable: Trainable, path: tuple = ()) -> dict:
  """The leaves of the nested dict `params` whose key path `trainable` accepts."""
  out = {}
  for key, value in params.items():
    if isinstance(value, Mapping):
      sub = select(value, trainable, path + (key,))
      if sub:
        out[key] = sub
    elif trainable(path + (key,)):
      out[key] = value
  return out


def merge(params: Mapping, subset: Mapping) -> dict:
  """`params` with the leaves of `subset` (same key paths) put in their place."""
  out = dict(params)
  for key, value in subset.items():
    out[key] = merge(params[key], value) if isinstance(value, Mapping) else value
  return out


def init_state(params: Mapping, tx: optax.GradientTransformation,
               trainable: Trainable | None = None) -> TrainState:
  """Step 0: a copy of `params` (the step donates its state) and the optimiser state of
  the trainable leaves."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a nested dict of arrays, got {type(params).__name__}")
  sub = params if trainable is None else select(params, trainable)
  if not jax.tree.leaves(sub):
    raise ValueError("trainable selects no parameter: check the predicate against the "
                     "key paths of params")
  params = jax.tree.map(jnp.copy, dict(params))
  sub = params if trainable is None else select(params, trainable)
  return TrainState(jnp.zeros((), jnp.int32), params, tx.init(sub))


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_step(loss_fn: LossFn, tx: optax.GradientTransformation, *,
              trainable: Trainable | None = None, state_shardings: Any = None,
              batch_shardings: Any = None, schedule: optax.Schedule | None = None,
              pass_step: bool = False, grad_accum: int = 1,
              prepass: Callable | None = None) -> StepFn:
  """Jitted `step(state, batch) -> (state, metrics)` with the state donated.

  `pass_step`: the loss is `loss_fn(params, batch, step)` (step: the int32 step being
  taken), e.g. to derive dropout keys that a resume reproduces.
  `grad_accum` > 1: the batch is taken as that many microbatches whose gradients are summed
  before the one update (prism_jax/train/accumulate.py; `prepass` and the loss's share).

  Metrics are `loss_fn`'s (plus `loss` if it has none), `grad_norm`, `lr` when a
  `schedule` is given, and `params_finite` (1.0 when the updated parameters are finite:
  a finite loss can still produce an overflowing update).

  Building a step changes no process state (the CPU allocator setting of
  cli/host_memory.py is the command-line launcher's opt-in).
  """

  def grads_of(fn, params, batch, extra, pre=prepass):
    if grad_accum == 1:
      return jax.value_and_grad(fn, has_aux=True)(params, batch, *extra)
    return accumulate.value_and_grad(fn, params, batch, extra, grad_accum, pre)

  def step(state: TrainState, batch):
    extra = (state.step,) if pass_step else ()
    if trainable is None:
      (loss, metrics), grads = grads_of(loss_fn, state.params, batch, extra)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = checked = optax.apply_updates(state.params, updates)
    else:
      sub = select(state.params, trainable)
      loss_of_sub = lambda s, b, *rest: loss_fn(merge(state.params, s), b, *rest)
      pre = None if prepass is None else (
          lambda s, *rest: prepass(merge(state.params, s), *rest))  # it reads every param
      (loss, metrics), grads = grads_of(loss_of_sub, sub, batch, extra, pre)
      updates, opt_state = tx.update(grads, state.opt_state, sub)
      checked = optax.apply_updates(sub, updates)
      params = merge(state.params, checked)
    metrics = dict(metrics)
    metrics.setdefault("loss", loss)
    metrics["grad_norm"] = optax.tree.norm(grads)
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    metrics["params_finite"] = _all_finite(checked).astype(jnp.float32)
    return TrainState(state.step + 1, params, opt_state), metrics

  if state_shardings is None and batch_shardings is None:
    return jax.jit(step, donate_argnums=0)
  return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, None), donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class Checkpointing:
  """Where and when the loop saves: every `every` steps and after the last one."""

  checkpointer: ckpt_lib.Checkpointer
  every: int
  data_state: Callable[[int], dict[str, Any]]  # the data position after `step` steps
  config: Any  # a Config or a JSON-able dict, saved beside the state


@dataclasses.dataclass(frozen=True)
class LoopResult:
  state: TrainState
  start_step: int
  final_step: int
  checkpoint_step: int | None  # the newest step saved (or restored), None if none
  train: Mapping[str, float]  # the last step's metrics (and rates, if logged)
  steady_tokens_per_s: float | None  # steps' tokens / their time (see metrics.Throughput)
  preempted: bool = False  # stopped early by `stop`, after saving its last step


class Loop:
  """Steps `start..steps-1`: one-step-late metrics, NaN guard, checkpoints, metrics
  writers (JSONL + TensorBoard under `workdir`, none without one) and progress."""

  def __init__(self, *, start: int, steps: int, log_every: int, workdir: str | None = None,
               checkpointing: Checkpointing | None = None,
               throughput: metrics_lib.Throughput | None = None, hint: str = "",
               stop: Callable[[int], bool] | None = None, log_to: str = "tensorboard",
               config: dict[str, Any] | None = None):
    """`stop(done)`, asked once after every step on every process (preemption.Preemption.
    reached): True saves that step (with `checkpointing`) and ends the run there."""
    if log_every < 1:
      raise ValueError(f"log_every must be >= 1, got {log_every}")
    self.start, self.steps, self.log_every = start, steps, log_every
    self.ckpt, self.thr, self.hint, self.stop = checkpointing, throughput, hint, stop
    trackers = parse_log_to(log_to)  # `log_to`: train.log_to; `config`: what W&B records
    self.writer = metrics_lib.MetricsWriter(
        workdir, start, tensorboard="tensorboard" in trackers, wandb="wandb" in trackers,
        config=config) if workdir else None
    self.progress = Progress(start, steps)
    self._pending = None  # (step, device metrics) not yet fetched
    self._last: dict[str, float] = {}
    self._compiled: set[int] = set()  # ids of step functions already called once

  def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
    if self.writer is not None:
      self.writer.write(step, split, metrics)

  def histogram(self, step: int, split: str, name: str, counts) -> None:
    if self.writer is not None:
      self.writer.histogram(step, split, name, counts)

  def note(self, text: str) -> None:
    self.progress.write(text)

  @contextlib.contextmanager
  def paused(self):
    """Leaves the enclosed work (eval, saves, compilation, init) out of the steady rate.
    Callers flush first where they need the pending step done: that wait is step time."""
    t0 = time.perf_counter()
    try:
      yield
    finally:
      if self.thr is not None:
        self.thr.exclude(time.perf_counter() - t0)

  def flush(self) -> None:
    """Fetches and checks the step not yet fetched (a sync point)."""
    if self._pending is not None:
      item, self._pending = self._pending, None
      self._consume(*item)

  def _diverged(self, step: int, bad: str) -> TrainingDivergedError:
    hint = self.hint or "Lower the learning rate or check the data."
    good = None
    if self.ckpt is not None:
      self.ckpt.checkpointer.wait()
      good = self.ckpt.checkpointer.latest_step()
    where = (f"step {good} in {self.ckpt.checkpointer.directory}" if good is not None
             else "none")
    return TrainingDivergedError(
        f"training diverged at step {step}: {bad}. Stopped; the bad state was not saved. "
        f"Last good checkpoint: {where}. {hint}")

  def _consume(self, step: int, m_dev) -> None:
    m = {k: float(v) for k, v in jax.device_get(m_dev).items()}
    if not np.isfinite(m["loss"]):
      raise self._diverged(step, f"non-finite loss ({m['loss']})")
    if m.pop("params_finite") != 1.0:
      raise self._diverged(step, f"non-finite parameters after the update (loss "
                                 f"{m['loss']:.4g}, grad_norm {m.get('grad_norm')})")
    log_due = step % self.log_every == 0 or step == self.steps
    rates = {}
    if self.thr is not None:
      self.thr.step()
      rates = self.thr.read() if log_due else {}
    self.write(step, "train", {**m, **rates})
    self.progress.update(step, m, rates, log_due)
    self._last = {**m, **rates}

  def run(self, state: TrainState, batches: Iterator, step_for: Callable[[int], StepFn], *,
          before_step: Callable[[int, TrainState], TrainState] | None = None,
          after_step: Callable[[int, TrainState], None] | None = None,
          callbacks: Sequence[Callback] = (), restored: bool = False) -> LoopResult:
    """Runs the steps; `before_step(s, state) -> state` and `after_step(done, state)` may
    call `flush()` first when they need the state known to be finite (they sync)."""
    ckpt_step = self.start if restored else None
    done, stopping = self.start, False
    try:
      if self.thr is not None:
        self.thr.start()
      for s in range(self.start, self.steps):
        if before_step is not None:
          state = before_step(s, state)
        batch = next(batches, None)
        if batch is None:
          raise ValueError(f"the batches ran out after {s} of {self.steps} steps")
        fn = step_for(s)
        if id(fn) in self._compiled:
          state, m_dev = fn(state, batch)
        else:  # the first call compiles (synchronously): not step time
          self.flush()
          with self.paused():
            state, m_dev = fn(state, batch)
            jax.block_until_ready(m_dev)
          self._compiled.add(id(fn))
        self.flush()
        self._pending = (s + 1, m_dev)
        done = s + 1
        stopping = self.stop is not None and self.stop(done)
        if self.ckpt is not None and (done % self.ckpt.every == 0 or done == self.steps
                                      or stopping):
          self.flush()  # never save a state that is not known to be finite
          with self.paused():
            self.ckpt.checkpointer.save(done, state, self.ckpt.data_state(done),
                                        self.ckpt.config)
            if self.writer is not None:
              self.writer.flush()  # an object store's metrics: uploaded with each save
          ckpt_step = done
        if after_step is not None:
          after_step(done, state)
        for cb in callbacks:
          cb(done, state)
        if stopping:
          break
      self.flush()
      if self.ckpt is not None:
        self.ckpt.checkpointer.wait()
    finally:
      self.progress.close()
      if self.writer is not None:
        self.writer.close()
    return LoopResult(state, self.start, done, ckpt_step, self._last,
                      None if self.thr is None else self.thr.overall(),
                      stopping and done < self.steps)


def _batches_from(batches: Iterable | Callable[[int], Iterator], start: int) -> Iterator:
  if callable(batches):
    return iter(batches(start))
  return itertools.islice(iter(batches), start, None)  # resume: skip what was consumed


class Trainer:
  """`loss_fn` + optimiser over a parameter subset: the jitted step and its loop.

  Args:
    loss_fn: `loss_fn(params, batch) -> (loss, metrics)`: a scalar loss and a dict of
      scalar metrics, from the whole parameter tree (a nested dict) and one batch.
    tx: the optax optimiser; its state covers the trainable leaves only.
    trainable: `trainable(path) -> bool` on each leaf's key path (the tuple of dict keys
      down to it): the leaves that get gradients and optimiser state; the others pass
      through the step unchanged. None (default) trains every leaf.
    schedule: the learning-rate schedule, only to log `lr` with the step's metrics (the
      schedule itself goes into `tx`); None (default) logs no `lr`.
    state_shardings: the shardings (a pytree matching TrainState) of the state the jitted
      step takes and returns; None (default) leaves its placement to jit.
    batch_shardings: the shardings of a batch given to the step; None (default) leaves
      its placement to jit.
  """

  def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation, *,
               trainable: Trainable | None = None, schedule: optax.Schedule | None = None,
               state_shardings: Any = None, batch_shardings: Any = None):
    self.tx, self.trainable = tx, trainable
    self.step = make_step(loss_fn, tx, trainable=trainable, schedule=schedule,
                          state_shardings=state_shardings, batch_shardings=batch_shardings)

  def init(self, params: Mapping) -> TrainState:
    """The step-0 training state of `params`.

    Args:
      params: the whole parameter tree, a nested dict of arrays; copied (the step donates
        its state), so the caller's arrays stay valid.

    Returns:
      A `TrainState`: step 0 (int32 scalar), the copied params and the optimiser state of
      the trainable leaves. A ValueError if `trainable` selects no leaf.
    """
    return init_state(params, self.tx, self.trainable)

  def fit(self, params: Mapping, batches: Iterable | Callable[[int], Iterator], *,
          steps: int, workdir: str | None = None, ckpt_every: int | None = None,
          log_every: int = 10, keep: int = 3, config: Mapping | None = None,
          tokens_per_step: int | None = None,
          callbacks: Sequence[Callback] = ()) -> LoopResult:
    """Trains `params` for `steps` steps (resuming from `workdir`'s newest checkpoint).

    Args:
      params: the whole parameter tree at step 0 (a nested dict of arrays); a resume
        replaces it with the checkpoint's.
      batches: an iterable of batches (a resume skips the ones already used) or a
        function `start_step -> iterator` of the batches from that step on. Running out
        before `steps` raises a ValueError.
      steps: the total number of steps the run ends at (counting those of a resumed
        checkpoint).
      workdir: the run directory for checkpoints and metrics (JSONL + TensorBoard); None
        (default) trains in memory: no checkpoint, no resume, no metrics files.
      ckpt_every: save a checkpoint every this many steps (and after the last one); None
        (default) saves after the last step only. Ignored without `workdir`.
      log_every: print progress (and the throughput rates) every this many steps, >= 1;
        10 by default.
      keep: the newest checkpoints kept in `workdir` (3 by default).
      config: a JSON-able dict saved with every checkpoint; a resume must find the same
        one (a ConfigMismatchError otherwise). None (default) is {}.
      tokens_per_step: tokens in one step's batch; given, tokens/s (and steps/s) join the
        logged metrics. None (default): no rates.
      callbacks: functions `callback(done, state)` called after every step with the
        number of steps completed and the TrainState (after any checkpoint save).

    Returns:
      A `LoopResult`: the final TrainState, the start step (0, or the resumed
      checkpoint's), the final step, the newest checkpoint step (None if none), the last
      step's metrics (a dict of floats) and the steady tokens/s (None without
      `tokens_per_step`).
    """
    state = self.init(params)
    thr = None
    if tokens_per_step is not None:
      thr = metrics_lib.Throughput(None, 0, tokens_per_step, jax.device_count())
    if workdir is None:
      loop = Loop(start=0, steps=steps, log_every=log_every, throughput=thr)
      return loop.run(state, _batches_from(batches, 0), lambda s: self.step,
                      callbacks=callbacks)
    config = dict(config or {})
    ckpt = ckpt_lib.Checkpointer(workdir, keep=keep)
    try:
      start, latest = 0, ckpt.latest_step()
      if latest is not None:
        saved = ckpt.read_config(latest)
        diffs = [(k, saved.get(k), config.get(k)) for k in sorted(set(saved) | set(config))
                 if saved.get(k) != config.get(k)]
        if diffs:
          raise ckpt_lib.ConfigMismatchError(ckpt_lib.describe_mismatch(diffs, ckpt.directory))
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state, _ = ckpt.restore(latest, target)
        start = latest
      saving = Checkpointing(ckpt, ckpt_every or steps, lambda done: {"step": done}, config)
      loop = Loop(start=start, steps=steps, log_every=log_every, workdir=workdir,
                  checkpointing=saving, throughput=thr)
      return loop.run(state, _batches_from(batches, start), lambda s: self.step,
                      callbacks=callbacks, restored=latest is not None)
    finally:
      ckpt.close()
