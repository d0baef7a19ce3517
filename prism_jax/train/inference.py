"""Loading a trained run for generation, attribution and analysis."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from prism_jax import io_guard, paths
from prism_jax.config import Config
from prism_jax.train import checkpoint as ckpt_lib
from prism_jax.train import integrity, overrides
from prism_jax.train.state import abstract_state, default_mesh, model_template


def load_config(workdir: str) -> Config:
  """The resolved Config of a run (<workdir>/config.json)."""
  return overrides.config_from_dict(ckpt_lib.read_workdir_config(workdir))


def load_tokenizer(workdir: str, cfg: Config):
  """The tokenizer saved beside the run's packed data."""
  from prism_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  return data_lib.load_tokenizer(io_guard.find_packed_dir(workdir, cfg.data.packed_dir))


def load_params(workdir: str, cfg: Config | None = None, step: int | None = None,
                mesh: jax.sharding.Mesh | None = None):
  """(graphdef, params, cfg, step) from the newest (or given) checkpoint, on `mesh`.

  `cfg` defaults to the checkpoint's own config; a given one must agree on model.*.
  """
  workdir = paths.resolve(workdir)
  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint {step} in {ckpt.directory}; have {steps}")
    saved = overrides.config_from_dict(ckpt.read_config(step))
    if cfg is None:
      cfg = saved
    else:
      diffs = [d for d in overrides.config_diff(saved, cfg, ckpt_lib.RESUMABLE_CHANGES)
               if d[0].startswith("model.")]
      if diffs:
        raise ckpt_lib.ConfigMismatchError(ckpt_lib.describe_mismatch(
            diffs, paths.join(ckpt.directory, str(step))))
    mesh = default_mesh(cfg) if mesh is None else mesh
    graphdef, _ = model_template(cfg.model)
    target = abstract_state(cfg, mesh).params
    with jax.set_mesh(mesh):
      try:
        params = ckpt.restore_params(step, target)
      except integrity.CheckpointCorruptError as e:
        older = [s for s in steps if s < step]
        raise integrity.CheckpointCorruptError(
            f"{e}. Checkpoint {step} is corrupt: load an older one (step= one of {older}) "
            "or resume training there, which quarantines it and falls back") from e
  finally:
    ckpt.manager.close()
  return graphdef, params, cfg, step


def load_for_inference(workdir: str, step: int | None = None,
                       mesh: jax.sharding.Mesh | None = None,
                       needs_prototypes: str | None = None) -> tuple[Any, Config, Any]:
  """(model, cfg, tokenizer) of a trained run: the NNX module with the checkpoint's params.

  `needs_prototypes` names what the caller does with the model ("a report", "suppression"):
  a dense run is then refused with one error, before its checkpoint is read.
  """
  if needs_prototypes is not None:
    kind = load_config(workdir).model.kind
    if kind != "prism":
      raise ValueError(f"{workdir} is a dense run (model.kind={kind!r}): {needs_prototypes} "
                       "needs prototypes; train with --model=prism")
  graphdef, params, cfg, _ = load_params(workdir, step=step, mesh=mesh)
  model = nnx.merge(graphdef, params)
  return model, cfg, load_tokenizer(workdir, cfg)
