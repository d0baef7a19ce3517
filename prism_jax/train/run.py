"""One training run of the model: `train(cfg, workdir) -> TrainResult` (resumes from <workdir>).

The data, the born-sharded state, the prototype init from data at `train.proto_init_step`
and the val evaluation around the shared loop of prism_jax.train.engine (one-step-late
metrics, NaN guard, checkpoints, metrics writers, progress).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import logging

from prism_jax import data as data_lib
from prism_jax import paths, run_lock
from prism_jax import sharding as shard_lib
from prism_jax.config import Config, config_diff, config_from_dict, finish, latest_proto_init
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax.train import validation
from prism_jax.train import init_from as init_from_lib
from prism_jax.train import metrics as metrics_lib
from prism_jax.train import step as step_lib
from prism_jax.train import engine
from prism_jax.train.preemption import Preemption
from prism_jax.train.progress import format_metrics
from prism_jax.train.recipe import Recipe
from prism_jax.train.state import TrainState, default_mesh
from prism_jax.train.engine import Callback


def prepare(cfg: Config, workdir: str, mesh) -> tuple[Any, Any, Any]:
  """(packed data, train loader, val loader or None) for this process."""
  init_from_lib.seed_tokenizer(cfg, workdir)
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  if packed.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"the tokenizer has {packed.vocab_size} ids but model.vocab_size="
                     f"{cfg.model.vocab_size}")
  if packed.seq_len != cfg.data.seq_len:
    raise ValueError(f"packed data has seq_len {packed.seq_len}, data.seq_len="
                     f"{cfg.data.seq_len}")
  index, count = shard_lib.process_batch_slice(mesh, cfg.train.batch_size)
  train_loader = data_lib.make_loader(packed, "train", cfg.train.batch_size, cfg.data.seed,
                                      index, count)
  val_loader = None
  if packed.num_rows("val") > 0:
    val_loader = data_lib.make_loader(packed, "val", cfg.train.batch_size, cfg.data.seed,
                                      index, count)
  return packed, train_loader, val_loader


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What `train()` returns: the run's summary fields (`summary()`, JSON-able) and the
  trained state."""

  workdir: str
  start_step: int
  final_step: int
  checkpoint_step: int | None  # the newest step on disk after the run
  train: Mapping[str, float]  # the last train metrics (and rates) of this call
  eval: Mapping[str, float]  # the last val metrics ({} without a val split)
  wall_s: float
  steady_tokens_per_s: float | None  # training steps only: eval, saves, compilation and
  # the prototype init are left out (metrics.Throughput)
  state: TrainState
  graphdef: Any
  preempted: bool = False  # stopped at final_step by a preemption notice, that step saved

  def summary(self) -> dict[str, Any]:
    """The JSON fields (everything but the live state and graphdef)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in ("state", "graphdef")}


def train(cfg: Config, workdir: str, *, mesh: jax.sharding.Mesh | None = None,
          callbacks: Sequence[Callback] = (),
          allow_config_change: Sequence[str] = (),
          start_over: bool = False,
          preemption: Preemption | None = None) -> TrainResult:
  """Trains (or resumes) `cfg` in `workdir`.

  `callbacks(step, state)` run after each dispatched step (and its checkpoint, if any).
  `allow_config_change` names fields of ckpt_lib.CHANGES_ON_REQUEST that may differ from
  the checkpoint's config (train.steps may always grow); a resume that changed fields
  records them in metrics.jsonl (split "config_change").
  `start_over` trains from step 0 when every checkpoint was quarantined as corrupt
  (otherwise that is refused with ckpt_lib.NoReadableCheckpointError).
  `preemption` (the launcher's, train/preemption.install): asked after every step; on a
  notice the step is saved and the run returns with `preempted` set (every process
  saves the same step).
  """
  t_start = time.time()
  workdir = paths.resolve(workdir)  # a local path or a gs:// URI
  paths.check_access(workdir)
  cfg = finish(cfg)  # checked, paths absolute (the stored config works from any cwd)
  paths.path(workdir).mkdir(parents=True, exist_ok=True)
  mesh = default_mesh(cfg) if mesh is None else mesh
  tc = cfg.train
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  if tc.batch_size % (dp * tc.grad_accum):
    raise ValueError(f"train.batch_size={tc.batch_size} must be divisible by the data-"
                     f"parallel size data*fsdp={dp} of the mesh {dict(mesh.shape)}"
                     + (f" times train.grad_accum={tc.grad_accum} (each microbatch spreads "
                        "over every device)" if tc.grad_accum > 1 else ""))
  unknown = sorted(set(allow_config_change) - set(ckpt_lib.CHANGES_ON_REQUEST)
                   - set(ckpt_lib.RESUMABLE_CHANGES))
  if unknown:
    raise ValueError(f"--allow_change {', '.join(unknown)}: only these fields may change "
                     f"on resume: {', '.join(ckpt_lib.CHANGES_ON_REQUEST)}")
  allow = ckpt_lib.RESUMABLE_CHANGES + tuple(allow_config_change)
  with run_lock.hold(workdir):  # one writer per run: a second one fails here, naming us
    latest = _check_resume(workdir, cfg, allow)
    packed, train_loader, val_loader = prepare(cfg, workdir, mesh)
    if cfg.train.init_from and latest is None:
      init_from_lib.check_source(cfg, packed.tokenizer)
    # Created only now: orbax's manager makes checkpoints/ and starts its threads, which a
    # data error above would leave behind (an empty folder, a traceback at exit).
    ckpt = ckpt_lib.Checkpointer(workdir, keep=tc.keep_checkpoints)
    try:
      return _run(cfg, workdir, mesh, ckpt, packed, train_loader, val_loader, callbacks,
                  allow, t_start, start_over, preemption)
    finally:
      ckpt.close()


def _check_resume(workdir: str, cfg: Config, allow: tuple[str, ...]) -> int | None:
  """The newest checkpoint's step (None: none yet), refusing a config mismatch or a shrunk
  train.steps before any slow data preparation (an unreadable one: restore_latest reports
  it and falls back)."""
  if not paths.path(paths.join(workdir, ckpt_lib.CKPT_DIR)).is_dir():
    return None
  reader = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    latest = reader.latest_step()
    if latest is not None and latest > cfg.train.steps:
      raise ckpt_lib.ConfigMismatchError(
          f"the newest checkpoint in {reader.directory} is at step {latest}, past "
          f"train.steps={cfg.train.steps}: train.steps may grow on resume, not shrink")
    if latest is not None:
      try:
        reader.check_config(latest, cfg, allow)
      except ckpt_lib.ConfigMismatchError:
        raise
      except Exception:  # pylint: disable=broad-except
        pass  # unreadable: restore_latest reports it and falls back
    return latest
  finally:
    reader.manager.close()


def _train_sample_loader(packed, cfg: Config, mesh):
  """Training rows for the train-split loss at each eval: a fixed shuffled sample, drawn
  with another seed than the training order."""
  index, count = shard_lib.process_batch_slice(mesh, cfg.train.batch_size)
  return data_lib.make_loader(packed, "train", cfg.train.batch_size,
                              (cfg.data.seed + 1) % 2**32, index, count)


def _run(cfg, workdir, mesh, ckpt, packed, train_loader, val_loader, callbacks, allow,
         t_start, start_over=False, preemption=None) -> TrainResult:
  tc = cfg.train
  with jax.set_mesh(mesh):
    recipe = Recipe(cfg, mesh)  # optimiser, template, shardings, phases: built once
    restored = ckpt.restore_latest(recipe.abstract_state(), cfg, allow, start_over)
    state, data_state, start = _starting_state(recipe, restored, ckpt, cfg, train_loader)
    ckpt_lib.write_config(workdir, cfg)
    eval_fn, train_eval_fn = _evaluators(recipe, cfg, mesh, packed, val_loader)
    thr = metrics_lib.Throughput(cfg.model, cfg.data.seq_len,
                                 tc.batch_size * cfg.data.seq_len, mesh.devices.size,
                                 loss_cfg=cfg.loss)
    saving = engine.Checkpointing(
        ckpt, tc.ckpt_every, lambda s: recipe.with_bank_state(train_loader.state(s)), cfg)
    loop = engine.Loop(start=start, steps=tc.steps, log_every=tc.log_every,
                        workdir=workdir, checkpointing=saving, throughput=thr,
                        hint="Lower train.lr or check the data.",
                        stop=None if preemption is None else preemption.reached,
                        log_to=tc.log_to, config=dataclasses.asdict(cfg))
    last_eval: dict[str, float] = {}

    def before_step(s: int, state: TrainState) -> TrainState:
      if not recipe.due(s):
        return state
      loop.flush()
      with loop.paused():  # the bank's init / revival is not training time
        state, note = recipe.before_step(s, state, train_loader)
      if note:
        loop.note(note)
      return state

    def run_eval(done: int, state: TrainState) -> None:
      nonlocal last_eval
      with loop.paused():
        last_eval = eval_fn(state.params)
        train_part = train_eval_fn(state.params)
        last_eval.update(train_loss=train_part["loss"], train_tokens=train_part["tokens"])
      loop.write(done, "val", last_eval)
      loop.histogram(done, "val", "prototype_usage", eval_fn.last_usage)
      loop.note(format_metrics(last_eval, lead=f"eval step {done}:"))

    def after_step(done: int, state: TrainState) -> None:
      if val_loader is not None and (done % tc.eval_every == 0 or done == tc.steps):
        loop.flush()
        run_eval(done, state)

    if restored is not None:
      _record_config_changes(loop, ckpt, start, cfg)
    elif val_loader is not None and tc.eval_at_start and start < tc.steps:
      run_eval(0, state)  # the untrained model: where the curves start

    batches = iter(())
    if start < tc.steps:
      batches = (step_lib.device_batch(b, mesh, tc.batch_size)
                 for b in train_loader.resume(data_state))
    out = loop.run(state, batches, recipe.step_for, before_step=before_step,
                   after_step=after_step,
                   callbacks=callbacks, restored=restored is not None)
  if not last_eval and val_loader is not None:  # e.g. a finished run re-opened: last record
    vals = [r for r in metrics_lib.read_metrics(workdir, "val")
            if r["step"] == out.final_step]
    last_eval = {k: v for k, v in vals[-1].items() if k not in ("step", "split")} if vals else {}
  return TrainResult(workdir, out.start_step, out.final_step, out.checkpoint_step,
                     dict(out.train), last_eval, time.time() - t_start,
                     out.steady_tokens_per_s, out.state, recipe.graphdef, out.preempted)


def _starting_state(recipe: Recipe, restored, ckpt, cfg: Config, train_loader):
  """(state, data-loader state, step) to start from: the restored checkpoint's (the bank's
  "auto" schedule checked), else the recipe's init (the pretrained backbone loaded in)."""
  if restored is not None:
    state, data_state, start = restored
    data_state = recipe.restore_bank_state(data_state)  # "auto": when the bank was set
    if recipe.auto_init and recipe.bank_set_at is None:
      _check_auto_schedule(ckpt, start, cfg)
    logging.info("resumed from checkpoint %d in %s", start, ckpt.directory)
    return state, data_state, start
  state = recipe.init_state()
  if cfg.train.init_from:
    state = init_from_lib.with_pretrained_backbone(state, recipe.shardings, cfg)
  return state, train_loader.state(0), 0


def _evaluators(recipe: Recipe, cfg: Config, mesh, packed, val_loader):
  """(val evaluator, train-split evaluator or None): the train-split loss on a fixed sample
  of as many batches as val uses."""
  params = recipe.shardings.params
  eval_fn = validation.Evaluator(recipe.graphdef, cfg, params, mesh, val_loader)
  if val_loader is None:
    return eval_fn, None
  return eval_fn, validation.Evaluator(recipe.graphdef, cfg, params, mesh,
                                       _train_sample_loader(packed, cfg, mesh),
                                       num_batches=eval_fn.num_batches)


def _check_auto_schedule(ckpt, step: int, cfg: Config) -> None:
  """train.proto_init_step="auto" decides at train.eval_every steps and by its latest step:
  a resume before it has set the bank must keep both (they may change once it has), or the
  bank would be set at another step than an uninterrupted run sets it."""
  saved = config_from_dict(ckpt.read_config(step)).train
  was = (saved.eval_every, latest_proto_init(saved))
  now = (cfg.train.eval_every, latest_proto_init(cfg.train))
  if was != now:
    raise ckpt_lib.ConfigMismatchError(
        f"checkpoint {step} of {ckpt.directory} has not set its bank yet "
        f"(train.proto_init_step=auto): its checks run every train.eval_every={was[0]} steps "
        f"and set the bank by step {was[1]}; this resume asks for {now[0]} and {now[1]}. "
        "Resume with the same train.eval_every and latest step (train.proto_init_latest, or "
        "the same train.steps when it is 0)")


def _record_config_changes(loop: engine.Loop, ckpt, step: int, cfg: Config) -> None:
  """A resume that changed allowed fields (a longer train.steps, --allow_change) writes
  one metrics.jsonl record {"split": "config_change", "step": step, field: [old, new]}."""
  diffs = config_diff(ckpt.read_config(step), cfg)
  if diffs:
    loop.write(step, "config_change", {k: [a, b] for k, a, b in diffs})
    loop.note(f"resumed at step {step} with "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in diffs))
