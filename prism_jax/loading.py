"""Loading a trained run: a run directory (local or gs://) -> model, config, tokenizer.

  model, cfg, tokenizer = load_for_inference("runs/demo")   # the newest checkpoint
  cfg = load_config("runs/demo")                            # config.json, nothing restored
  graphdef, params, cfg, step = load_params("runs/demo", step=600)

Generation, attribution, reports, the explorer and `prism_jax.load` all start here. Reading
the checkpoint format itself (restore, integrity, config agreement) is the checkpoint
module's (prism_jax/train/checkpoint.py); this module only assembles what a user of a
trained run needs, so nothing outside training imports the training loop to read a run.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from prism_jax import data as data_lib
from prism_jax.config import Config
from prism_jax.train.checkpoint import load_config, load_params

__all__ = ["load_config", "load_for_inference", "load_params", "load_tokenizer"]


def load_tokenizer(workdir: str, cfg: Config):
  """The tokenizer saved beside the run's packed data."""
  return data_lib.run_tokenizer(workdir, cfg.data.packed_dir)


def load_for_inference(workdir: str, step: int | None = None,
                       mesh: jax.sharding.Mesh | None = None,
                       needs_prototypes: str | None = None) -> tuple[Any, Config, Any]:
  """A trained run's model with its checkpoint's parameters, its config and its tokenizer.

  Args:
    workdir: the run directory (local or gs://), as `prism train` wrote it.
    step: the checkpoint to read; None (default) reads the newest.
    mesh: where the parameters are placed; None uses the run's own mesh settings.
    needs_prototypes: what the caller does with the model ("a report", "suppression"):
      a dense run is then refused with one error, before its checkpoint is read.

  Returns:
    (model, cfg, tokenizer): the NNX module, the run's resolved Config and the tokenizer
    saved beside its packed data.
  """
  if needs_prototypes is not None:
    kind = load_config(workdir).model.kind
    if kind != "prism":
      raise ValueError(f"{workdir} is a dense run (model.kind={kind!r}): {needs_prototypes} "
                       "needs prototypes; train with --model=prism")
  graphdef, params, cfg, _ = load_params(workdir, step=step, mesh=mesh)
  model = nnx.merge(graphdef, params)
  return model, cfg, load_tokenizer(workdir, cfg)
