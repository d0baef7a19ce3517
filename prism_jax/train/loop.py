"""The training loop: `train(cfg, workdir) -> summary` (resumes from <workdir>).

Per step s: dispatch step s, then fetch step s-1's metrics (the host never waits for the
step it just launched); the NaN/Inf guard runs on what was fetched. Before a checkpoint
the step being saved is fetched and checked, so a non-finite state is never saved.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from prism_jax import sharding as shard_lib
from prism_jax.config import Config
from prism_jax.io_guard import resolve_config_paths
from prism_jax.model.lm import init_prototypes_from_hidden
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax.train import evaluation
from prism_jax.train import metrics as metrics_lib
from prism_jax.train import step as step_lib
from prism_jax.train.optimizer import PROTO_PATH, make_optimizer, reset_moments
from prism_jax.train.state import (TrainState, abstract_state, create_train_state,
                                   default_mesh, model_template, state_shardings)

Callback = Callable[[int, TrainState], None]


class TrainingDivergedError(FloatingPointError):
  """A step produced a non-finite loss or parameters; nothing after it was saved."""


def _shard_of(mesh, global_batch: int) -> tuple[int, int]:
  fn = getattr(shard_lib, "process_batch_slice", None)
  if fn is not None:
    return fn(mesh, global_batch)
  return jax.process_index(), jax.process_count()


def prepare(cfg: Config, workdir: str, mesh) -> tuple[Any, Any, Any]:
  """(packed data, train loader, val loader or None) for this process."""
  from prism_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  if packed.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"the tokenizer has {packed.vocab_size} ids but model.vocab_size="
                     f"{cfg.model.vocab_size}")
  if packed.seq_len != cfg.data.seq_len:
    raise ValueError(f"packed data has seq_len {packed.seq_len}, data.seq_len="
                     f"{cfg.data.seq_len}")
  index, count = _shard_of(mesh, cfg.train.batch_size)
  train_loader = data_lib.make_loader(packed, "train", cfg.train.batch_size, cfg.data.seed,
                                      index, count)
  val_loader = None
  if packed.num_rows("val") > 0:
    val_loader = data_lib.make_loader(packed, "val", cfg.train.batch_size, cfg.data.seed,
                                      index, count)
  return packed, train_loader, val_loader


def proto_init_due(cfg: Config, step: int) -> bool:
  return (cfg.model.kind == "prism" and cfg.model.proto_init == "data"
          and step == cfg.train.proto_init_step)


def init_prototypes(graphdef, state: TrainState, shardings: TrainState, cfg: Config,
                    tokens_BxT: np.ndarray, mask_BxT: np.ndarray) -> TrainState:
  """Bank <- hidden states of the given tokens (k-means++), Adam moments of the bank reset.

  Deterministic in (train.seed, state.step) and the parameters, so a resume reproduces it.
  """
  step = int(jax.device_get(state.step))
  seed = int(np.random.SeedSequence([cfg.train.seed, step]).generate_state(1)[0])
  module = nnx.merge(graphdef, state.params)
  init_prototypes_from_hidden(module, tokens_BxT, seed=seed, mask_BxT=mask_BxT,
                              kmeans_pp=True)
  protos = np.asarray(module.bank.protos[...])
  params = jax.tree.map(lambda x: x, state.params)
  params[PROTO_PATH[0]][PROTO_PATH[1]] = jax.device_put(
      protos, shardings.params[PROTO_PATH[0]][PROTO_PATH[1]])
  opt_state = jax.device_put(reset_moments(state.opt_state), shardings.opt_state)
  return TrainState(state.step, params, opt_state)


def _proto_init_tokens(loader, cfg: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
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


def _terminal_width() -> int:
  """Columns of the terminal on stderr; 0 when it is not a (sized) TTY."""
  try:
    return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else 0
  except (OSError, ValueError):
    return 0


class _Progress:
  """tqdm on a TTY, plain absl log lines every `log_every` steps otherwise."""

  def __init__(self, start: int, total: int, log_every: int):
    self.log_every, self.total = log_every, total
    self.bar = None
    if _terminal_width() > 0 and jax.process_index() == 0:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

  def update(self, step: int, m: dict[str, float], rates: dict[str, float]) -> None:
    if self.bar is not None:
      self.bar.update(1)
      post = {"loss": f"{m['loss']:.4f}"}
      if rates.get("tokens_per_s"):
        post["tok/s"] = f"{rates['tokens_per_s']:,.0f}"
      self.bar.set_postfix(post, refresh=False)
    elif rates or step == self.total:
      logging.info("step %d/%d %s", step, self.total, format_metrics({**m, **rates}))

  def write(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(text)
    else:
      logging.info("%s", text)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def format_metrics(m: dict[str, Any]) -> str:
  parts = []
  for k, v in m.items():
    if isinstance(v, float):
      parts.append(f"{k} {v:,.4g}" if abs(v) < 1e4 else f"{k} {v:,.0f}")
    else:
      parts.append(f"{k} {v}")
  return " | ".join(parts)


def train(cfg: Config, workdir: str, *, mesh: jax.sharding.Mesh | None = None,
          callbacks: Sequence[Callback] = (),
          allow_config_change: Sequence[str] = (),
          start_over: bool = False) -> dict[str, Any]:
  """Trains (or resumes) `cfg` in `workdir`; returns a summary dict.

  `callbacks(step, state)` run after each dispatched step (and its checkpoint, if any).
  `allow_config_change` adds dotted keys that may differ from the checkpoint's config.
  `start_over` trains from step 0 when every checkpoint was quarantined as corrupt
  (otherwise that is refused with ckpt_lib.NoReadableCheckpointError).
  """
  t_start = time.time()
  workdir = os.path.abspath(workdir)
  cfg = resolve_config_paths(cfg)  # stored absolute: the run works from any cwd
  os.makedirs(workdir, exist_ok=True)
  mesh = default_mesh(cfg) if mesh is None else mesh
  tc = cfg.train
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if tc.batch_size % dp:
    raise ValueError(f"train.batch_size={tc.batch_size} must be divisible by the data-"
                     f"parallel size data*fsdp={dp} of the mesh {dict(mesh.shape)}")
  allow = ckpt_lib.RESUMABLE_CHANGES + tuple(allow_config_change)
  ckpt = ckpt_lib.Checkpointer(workdir, keep=tc.keep_checkpoints)
  try:
    latest = ckpt.latest_step()
    if latest is not None:  # refuse a mismatch before any slow data preparation
      try:
        ckpt.check_config(latest, cfg, allow)
      except ckpt_lib.ConfigMismatchError:
        raise
      except Exception:  # pylint: disable=broad-except
        pass  # unreadable: restore_latest reports it and falls back
    packed, train_loader, val_loader = prepare(cfg, workdir, mesh)
    return _run(cfg, workdir, mesh, ckpt, packed, train_loader, val_loader, callbacks,
                allow, t_start, start_over)
  finally:
    ckpt.close()


def _run(cfg, workdir, mesh, ckpt, packed, train_loader, val_loader, callbacks, allow,
         t_start, start_over=False) -> dict[str, Any]:
  tc = cfg.train
  tx = make_optimizer(tc)
  with jax.set_mesh(mesh):
    graphdef, _ = model_template(cfg.model)
    restored = ckpt.restore_latest(abstract_state(cfg, mesh, tx), cfg, allow, start_over)
    if restored is not None:
      state, data_state, start = restored
      shardings = state_shardings(cfg, mesh, tx)
      logging.info("resumed from checkpoint %d in %s", start, ckpt.directory)
    else:
      graphdef, state, shardings = create_train_state(cfg, mesh, tx)
      data_state, start = train_loader.state(0), 0
    ckpt_lib.write_config(workdir, cfg)

    fns: dict[bool, Callable] = {}

    def step_fn(dense: bool):
      if dense not in fns:
        fns[dense] = step_lib.make_train_step(graphdef, cfg, tx, shardings, mesh,
                                              dense_phase=dense)
      return fns[dense]

    eval_fn = evaluation.Evaluator(graphdef, cfg, shardings.params, mesh, val_loader)
    writer = metrics_lib.MetricsWriter(workdir, start)
    tokens_per_step = tc.batch_size * cfg.data.seq_len
    thr = metrics_lib.Throughput(cfg.model, cfg.data.seq_len, tokens_per_step,
                                 mesh.devices.size)
    progress = _Progress(start, tc.steps, tc.log_every)
    summary: dict[str, Any] = {"workdir": workdir, "start_step": start, "final_step": start,
                               "checkpoint_step": start if restored else None}
    last_train: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    rates_hist: list[float] = []
    pending = None  # (step, device metrics) not yet fetched
    warm_dense = step_lib.uses_dense_warmup(cfg)
    batches = train_loader.resume(data_state) if start < tc.steps else iter(())

    def consume(item):
      nonlocal last_train
      step, m_dev = item
      m = {k: float(v) for k, v in jax.device_get(m_dev).items()}
      bad = None
      if not np.isfinite(m["loss"]):
        bad = f"non-finite loss ({m['loss']})"
      elif m.pop("params_finite") != 1.0:
        bad = f"non-finite parameters after the update (loss {m['loss']:.4g}, grad_norm " \
              f"{m.get('grad_norm')})"
      if bad:
        ckpt.wait()
        good = ckpt.latest_step()
        raise TrainingDivergedError(
            f"training diverged at step {step}: {bad}. Stopped; the bad state was not "
            f"saved. Last good checkpoint: "
            + (f"step {good} in {ckpt.directory}" if good is not None else "none")
            + ". Lower train.lr or check the data.")
      m.pop("params_finite", None)
      thr.step()
      rates = thr.read() if (step % tc.log_every == 0 or step == tc.steps) else {}
      if rates and step - start > tc.log_every:  # skip the window holding compilation
        rates_hist.append(rates["tokens_per_s"])
      writer.write(step, "train", {**m, **rates})
      progress.update(step, m, rates)
      last_train = {**m, **rates}

    try:
      thr.start()
      for s in range(start, tc.steps):
        if proto_init_due(cfg, s):
          if pending is not None:
            consume(pending)
            pending = None
          toks, mask = _proto_init_tokens(train_loader, cfg, s)
          state = init_prototypes(graphdef, state, shardings, cfg, toks, mask)
          progress.write(f"step {s}: prototypes set from {int(mask.sum())} hidden states "
                         "(k-means++)")
        batch = step_lib.device_batch(next(batches), mesh, tc.batch_size)
        dense = warm_dense and s < tc.proto_init_step
        state, m_dev = step_fn(dense)(state, batch)
        if pending is not None:
          consume(pending)
        pending = (s + 1, m_dev)
        done = s + 1
        if done % tc.ckpt_every == 0 or done == tc.steps:
          consume(pending)  # never save a state that is not known to be finite
          pending = None
          ckpt.save(done, state, train_loader.state(done), cfg)
          summary["checkpoint_step"] = done
        if val_loader is not None and (done % tc.eval_every == 0 or done == tc.steps):
          if pending is not None:
            consume(pending)
            pending = None
          last_eval = eval_fn(state.params)
          writer.write(done, "val", last_eval)
          progress.write(f"eval step {done}: {format_metrics(last_eval)}")
        for cb in callbacks:
          cb(done, state)
        summary["final_step"] = done
      if pending is not None:
        consume(pending)
      ckpt.wait()
    finally:
      progress.close()
      writer.close()
  if not last_eval and val_loader is not None:  # e.g. a finished run re-opened: last record
    vals = [r for r in metrics_lib.read_metrics(workdir, "val")
            if r["step"] == summary["final_step"]]
    last_eval = {k: v for k, v in vals[-1].items() if k not in ("step", "split")} if vals else {}
  summary.update(train=last_train, eval=last_eval, wall_s=time.time() - t_start,
                 tokens_per_s=float(np.median(rates_hist)) if rates_hist else None,
                 state=state, graphdef=graphdef)
  return summary
