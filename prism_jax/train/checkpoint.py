"""Orbax checkpoints: params + optimizer + step + data state + the resolved config (JSON).

Layout: <workdir>/checkpoints/<step>/{params, opt, data, config}. Saves are async and
keep the newest `train.keep_checkpoints`. Restores go into an abstract target carrying the
current mesh's shardings (so a run may resume on another mesh). A checkpoint whose config
differs from the requested one (in fields that change the math) is refused, naming the
fields; an unreadable checkpoint is reported, moved to <workdir>/corrupt_checkpoints/
(never deleted) and the previous one is used.

Integrity (train/integrity.py): every checkpoint carries a `digest` item (per-array
checksums of params and optimizer state, and a hash of the config and data items, saved
in the same atomic orbax finalize). A
restore that does not match it, or restores a non-finite value, is treated exactly like an
unreadable checkpoint. Checkpoints written before digests existed load with a warning
(finiteness is still checked). When no checkpoint is left readable but some were
quarantined, resuming is refused (NoReadableCheckpointError) unless start_over=True.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from prism_jax import paths
from prism_jax.config import Config, config_diff, config_from_dict, to_dict, to_json
from prism_jax.train import integrity
from prism_jax.train.state import TrainState, abstract_state, default_mesh, model_template

CKPT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
CONFIG_FILE = "config.json"
DIGEST_ITEM = "digest"

# Fields that may change between a checkpoint and its resume: bookkeeping, placement and
# kernel choice, none of which changes what is computed.
# May differ on every resume: bookkeeping, the mesh, the implementation, and train.steps
# (a finished run may be trained longer: the LR schedule is the one of the new train.steps,
# so its cosine end moves; steps already taken and the data order are unchanged).
RESUMABLE_CHANGES = (
    "train.steps", "train.eval_every", "train.eval_batches", "train.eval_at_start",
    "train.ckpt_every", "train.keep_checkpoints", "train.log_every", "mesh.data", "mesh.fsdp",
    "mesh.model", "data.packed_dir", "model.implementation", "model.remat",
    # the same update in other microbatches (train/accumulate.py): fit a resumed run to a
    # smaller slice
    "train.grad_accum",
    "train.log_to",  # trackers: a resumed run may start or stop logging to one
)
# May differ on a resume only when asked for (`train(allow_config_change=...)`, the CLI's
# --allow_change), e.g. a lower train.lr after a divergence.
CHANGES_ON_REQUEST = (
    "train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay",
    "train.grad_clip", "loss.lambda_rec", "loss.lambda_r1", "loss.lambda_r2",
    "train.revive_every",  # turn revival on (or off) for a bank that is dying
)


class ConfigMismatchError(ValueError):
  """The requested config differs from the checkpoint's in fields that matter."""


class NoReadableCheckpointError(RuntimeError):
  """Every checkpoint of a run was quarantined; resuming would silently start over."""


def describe_mismatch(diffs: list[tuple[str, Any, Any]], where: str) -> str:
  lines = [f"  {k}: checkpoint {a!r}, requested {b!r}" for k, a, b in diffs]
  return (f"the checkpoint in {where} was trained with a different config:\n"
          + "\n".join(lines) + "\nuse a new --workdir, or pass the checkpoint's values "
          "(see its config.json)")


def write_config(workdir: str, cfg: Config) -> str:
  path = paths.join(workdir, CONFIG_FILE)
  if jax.process_index() == 0:
    paths.write_text_atomic(path, to_json(cfg))
  return path


class Checkpointer:
  """Thin wrapper over ocp.CheckpointManager with the items above."""

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.workdir = paths.resolve(workdir)  # a local path or a gs:// URI
    paths.check_access(self.workdir)
    self.directory = paths.join(self.workdir, CKPT_DIR)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only)
    self.manager = ocp.CheckpointManager(paths.path(self.directory), options=options)

  # ------------------------------------------------------------------ saving
  def save(self, step: int, state: TrainState, data_state: dict[str, Any],
           cfg: Config | Mapping[str, Any]):
    """Starts an async save (device->host copy happens before this returns). `cfg` is the
    run's Config, or a JSON dict for a trainer that has none (prism_jax.train.engine)."""
    opt = {"step": state.step, "opt_state": state.opt_state}
    config = dict(cfg) if isinstance(cfg, Mapping) else to_dict(cfg)
    # Every item is covered: the arrays by their checksums, the JSON items (the config the
    # readers build the model from, the data position) by a hash of their content.
    digests = {"params": integrity.digest(state.params), "opt": integrity.digest(opt),
               "config": integrity.json_digest(config),
               "data": integrity.json_digest(data_state)}
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        opt=ocp.args.StandardSave(opt),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config),
        **{DIGEST_ITEM: ocp.args.JsonSave(digests)})
    self.manager.save(int(step), args=args, force=True)

  def wait(self) -> None:
    """Blocks until pending saves are on disk; raises if one failed."""
    self.manager.wait_until_finished()
    self.manager.check_for_errors()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()

  # ------------------------------------------------------------------ reading
  def all_steps(self) -> list[int]:
    self.manager.reload()
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def read_config(self, step: int) -> dict[str, Any]:
    """The config item of `step`, checked against its digest (CheckpointCorruptError when
    it was edited or damaged; checkpoints older than the config digest load unchecked)."""
    return self._read_json_item(step, "config")

  def read_data_state(self, step: int) -> dict[str, Any]:
    """The data item of `step` (the loader's position; with train.proto_init_step=auto, the
    step the bank was set at), checked against its digest like the config."""
    return self._read_json_item(step, "data")

  def _read_json_item(self, step: int, item: str) -> dict[str, Any]:
    out = self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
    value = dict(out[item])
    digests = self.read_digests(step, warn=False)  # the array reads warn of an old one
    if digests is not None and item in digests:
      integrity.verify_json(value, digests[item], paths.join(self.directory, str(step), item))
    return value

  def read_digests(self, step: int, warn: bool = True) -> dict[str, Any] | None:
    """The saved per-array digests of `step`; None (with a warning, unless `warn` is False)
    for an older checkpoint written before digests existed."""
    if not paths.path(self.directory).joinpath(str(step), DIGEST_ITEM).is_dir():
      if warn:
        logging.warning("checkpoint %d in %s has no checksums (written before they existed); "
                        "loading it unverified (only finiteness is checked)", step,
                        self.directory)
      return None
    out = self.manager.restore(step, args=ocp.args.Composite(
        **{DIGEST_ITEM: ocp.args.JsonRestore()}))
    return dict(out[DIGEST_ITEM])

  def restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """(state, data_state) of `step`, placed as `target`'s shardings say; verified against
    its digests (CheckpointCorruptError on a mismatch or a non-finite value)."""
    digests = self.read_digests(step)
    out = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target.params),
        opt=ocp.args.StandardRestore({"step": target.step, "opt_state": target.opt_state}),
        data=ocp.args.JsonRestore()))
    opt = out["opt"]
    where = paths.join(self.directory, str(step))
    integrity.verify(out["params"], digests and digests["params"], f"{where}/params")
    integrity.verify(opt, digests and digests["opt"], f"{where}/opt")
    if digests and "data" in digests:
      integrity.verify_json(dict(out["data"]), digests["data"], f"{where}/data")
    return TrainState(opt["step"], out["params"], opt["opt_state"]), dict(out["data"])

  def restore_params(self, step: int, target_params: Any) -> Any:
    digests = self.read_digests(step)
    out = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target_params)))
    integrity.verify(out["params"], digests and digests["params"],
                     paths.join(self.directory, str(step), "params"))
    return out["params"]

  def check_config(self, step: int, cfg: Config,
                   allow: tuple[str, ...] = RESUMABLE_CHANGES) -> None:
    diffs = config_diff(self.read_config(step), cfg, ignore=allow)
    if diffs:
      raise ConfigMismatchError(describe_mismatch(diffs, paths.join(self.directory,
                                                                    str(step))))

  def _quarantine(self, step: int) -> str:
    src = paths.path(self.directory) / str(step)
    dst = paths.join(self.workdir, CORRUPT_DIR, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
    if jax.process_index() == 0 and src.exists():
      paths.path(dst).parent.mkdir(parents=True, exist_ok=True)
      paths.move_tree(src, dst)
    self.manager.reload()
    return dst

  def quarantined(self) -> list[str]:
    """Paths of the checkpoints moved aside as corrupt, oldest name first."""
    root = paths.path(self.workdir) / CORRUPT_DIR
    return [os.fspath(p) for p in sorted(root.iterdir(), key=lambda p: p.name)] \
        if root.is_dir() else []

  def restore_latest(self, target: TrainState, cfg: Config,
                     allow: tuple[str, ...] = RESUMABLE_CHANGES, start_over: bool = False):
    """(state, data_state, step) of the newest readable checkpoint, or None if none.

    A config mismatch raises ConfigMismatchError (nothing is moved or deleted). An
    unreadable or corrupt checkpoint is logged, moved aside and the previous one tried.
    None with quarantined checkpoints raises NoReadableCheckpointError unless start_over.
    """
    restored = self._restore_newest(target, cfg, allow)
    if restored is None and self.quarantined() and not start_over:
      raise NoReadableCheckpointError(
          f"no readable checkpoint left in {self.directory}; quarantined as corrupt: "
          + ", ".join(self.quarantined()) + ". Refusing to restart from step 0 silently: "
          "pass --start_over (train(..., start_over=True)) to train from scratch, or use "
          "a new --workdir")
    return restored

  def _restore_newest(self, target, cfg, allow):
    for step in reversed(self.all_steps()):
      try:
        saved_cfg = self.read_config(step)
      except Exception as e:  # pylint: disable=broad-except
        self._report_corrupt(step, e)
        continue
      diffs = config_diff(saved_cfg, cfg, ignore=allow)
      if diffs:
        raise ConfigMismatchError(describe_mismatch(diffs, paths.join(self.directory,
                                                                      str(step))))
      try:
        state, data_state = self.restore(step, target)
      except Exception as e:  # pylint: disable=broad-except
        self._report_corrupt(step, e)
        continue
      return state, data_state, step
    return None

  def _report_corrupt(self, step: int, err: Exception) -> None:
    dst = self._quarantine(step)
    kind = "corrupt" if isinstance(err, integrity.CheckpointCorruptError) else "unreadable"
    logging.error("checkpoint %d in %s is %s (%s: %s); moved it to %s and falling "
                  "back to the previous checkpoint", step, self.directory, kind,
                  type(err).__name__, str(err).splitlines()[0] if str(err) else "", dst)


def read_workdir_config(workdir: str) -> dict[str, Any]:
  path = paths.path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{workdir} has no {CONFIG_FILE}: not a prism_jax run directory")
  return json.loads(path.read_text())


# Reading a run back (prism_jax/loading.py builds the model from these; train/init_from.py
# reads a source run with them).
def load_config(workdir: str) -> Config:
  """The resolved Config of a run (<workdir>/config.json)."""
  return config_from_dict(read_workdir_config(workdir))


def load_params(workdir: str, cfg: Config | None = None, step: int | None = None,
                mesh: jax.sharding.Mesh | None = None):
  """(graphdef, params, cfg, step) from the newest (or given) checkpoint, on `mesh`.

  The architecture is the checkpoint's own config item (its digest checked): a config.json
  that disagrees is reported in one warning. `cfg`, when given, must agree on model.*. A
  damaged checkpoint (truncated or missing file, wrong shape, changed bytes) raises
  integrity.CheckpointCorruptError in one line naming it and the steps that load instead.
  """
  workdir = paths.resolve(workdir)
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint {step} in {ckpt.directory}; have {steps}")
    with _damage_reported(ckpt.directory, step, steps):
      raw = ckpt.read_config(step)
    saved = config_from_dict(raw)  # a config this version refuses: its own error
    warn_if_config_file_differs(workdir, saved, step)
    if cfg is None:
      cfg = saved
    else:
      diffs = [d for d in config_diff(saved, cfg, RESUMABLE_CHANGES)
               if d[0].startswith("model.")]
      if diffs:
        raise ConfigMismatchError(describe_mismatch(
            diffs, paths.join(ckpt.directory, str(step))))
    mesh = default_mesh(cfg) if mesh is None else mesh
    graphdef, _ = model_template(cfg.model)
    target = abstract_state(cfg, mesh).params
    with jax.set_mesh(mesh), _damage_reported(ckpt.directory, step, steps):
      params = ckpt.restore_params(step, target)
  finally:
    ckpt.manager.close()
  return graphdef, params, cfg, step


def model_differences(workdir: str, saved: Config) -> list[tuple[str, Any, Any]]:
  """model.* fields where <workdir>/config.json disagrees with `saved` (the checkpoint's
  own config): [(field, config.json's, checkpoint's)]; [] when it agrees or is absent."""
  try:
    written = config_from_dict(read_workdir_config(workdir))
  except FileNotFoundError:
    return []
  except ValueError as e:  # unparsable, or a value no config may hold
    return [(CONFIG_FILE, f"invalid: {_first_line(e)}", "valid")]
  diffs = config_diff(written, saved, RESUMABLE_CHANGES)
  return [d for d in diffs if d[0].startswith("model.")]


def describe_differences(workdir: str, step: int, diffs: list[tuple[str, Any, Any]]) -> str:
  """'<workdir>/config.json disagrees with checkpoint <step>'s own config in ...': the
  first three of model_differences' fields."""
  return (f"{workdir}/{CONFIG_FILE} disagrees with checkpoint {step}'s own config in "
          + ", ".join(f"{k} (file {a!r}, checkpoint {b!r})" for k, a, b in diffs[:3]))


def warn_if_config_file_differs(workdir: str, saved: Config, step: int) -> None:
  diffs = model_differences(workdir, saved)
  if diffs:
    logging.warning("%s; using the checkpoint's (the weights were trained with it)",
                    describe_differences(workdir, step, diffs))


@contextlib.contextmanager
def _damage_reported(directory: str, step: int, steps: list[int]):
  """Any failure to read checkpoint `step` -> one CheckpointCorruptError line naming the
  checkpoint (and the file, when the reader's message names one) and the other steps."""
  try:
    yield
  except (FileNotFoundError, ConfigMismatchError, MemoryError, jax.errors.JaxRuntimeError):
    raise  # not the checkpoint's damage: a missing step, a mismatch, the device
  except Exception as e:  # pylint: disable=broad-except
    inflight = False
    where = paths.join(directory, str(step))
    others = [s for s in steps if s != step]
    hint = (f"load another one (step= one of {others}) or resume training, which "
            "quarantines it and falls back" if others else "no other checkpoint is left")
    if isinstance(e, integrity.CheckpointCorruptError):
      what = str(e).splitlines()[0]
    else:
      inflight = True
      named = _file_named(str(e), where)
      what = (f"{where} cannot be read" + (f" ({named})" if named else "")
              + f": {type(e).__name__}: {_first_line(e)}")
    err = integrity.CheckpointCorruptError(f"checkpoint {step} is damaged: {what}. {hint}")
    # A failed orbax restore can leave TensorStore reads in flight that complete into its
    # closed event loop and print tracebacks from their thread: the launcher gives them a
    # moment before its one-line report (cli/launcher.py).
    err.reads_in_flight = inflight
    raise err from e


def _file_named(message: str, where: str) -> str | None:
  """The first path under `where` that a reader's (tensorstore's, orbax's) message names."""
  found = re.search(re.escape(paths.path(where).as_posix()) + r"[^\s\"',:;]*", message)
  return found.group(0) if found else None


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  # TensorStore appends "See full TensorStore details: <bound method ...>": no detail
  text = text.split(" See full TensorStore details")[0]
  return (text.splitlines()[0] if text else "")[:200]
