"""A config finished for a run: checked whole and its paths made absolute.

  cfg = finish(build_config("tiny", sets=["train.steps=100"]))   # what train() runs

`train()` finishes the config it is given before it prepares or writes anything, so a
caller may hand it a config built any way (a preset, a file, overrides); finishing a
finished config changes nothing. Finishing:
- refuses a PRISM run whose bank would never be set from data (`bank_init_problem`), in
  one line naming both settings;
- makes data.packed_dir and train.init_from absolute against the directory the user typed
  them in, so the run's stored config works from any cwd (gs:// URIs stand as written).
"""

from __future__ import annotations

import dataclasses
import os

from prism_jax import paths
from prism_jax.config import Config, bank_init_problem


def _absolute_paths(cfg: Config) -> Config:
  packed, src = cfg.data.packed_dir, cfg.train.init_from
  if packed and not os.path.isabs(packed) and not paths.is_remote(packed):
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                            packed_dir=paths.resolve(packed)))
  if src and not os.path.isabs(src) and not paths.is_remote(src):
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                             init_from=os.path.abspath(src)))
  return cfg


def finish(cfg: Config) -> Config:
  """`cfg` checked and with absolute paths (see the module doc); ValueError, one line, for
  a config no run can train."""
  problem = bank_init_problem(cfg)
  if problem:
    raise ValueError(problem)
  return _absolute_paths(cfg)
