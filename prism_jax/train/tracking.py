"""Experiment trackers beside metrics.jsonl: `train.log_to` (comma list).

  tensorboard   tensorboardX event files under <workdir>/tb (the default)
  wandb         Weights & Biases (the `wandb` extra): the same scalars as metrics.jsonl
                ("<split>/<name>" at the run's step), the config, and at each eval the
                report's prototype-usage histogram ("val/prototype_usage", log10(1 +
                tokens that selected each prototype)); offline with WANDB_MODE=offline
                (no network; `wandb sync` uploads later)

A W&B run's id is kept in <workdir>/wandb_run_id, so a resumed training run continues the
same tracked run (`resume="allow"`). Only process 0 tracks (as it alone writes metrics).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from typing import Any

import numpy as np

from prism_jax import paths

TRACKERS = ("tensorboard", "wandb")
RUN_ID_FILE = "wandb_run_id"


def parse_log_to(log_to: str) -> tuple[str, ...]:
  """The trackers of a `train.log_to` value; ValueError naming an unknown one."""
  names = tuple(n.strip() for n in log_to.split(",") if n.strip())
  bad = [n for n in names if n not in TRACKERS]
  if bad:
    raise ValueError(f"train.log_to: unknown tracker {bad[0]!r}; choose from "
                     f"{', '.join(TRACKERS)} (comma-separated, '' for metrics.jsonl only)")
  return names


class WandbTracker:
  """One W&B run per training workdir, resumed across restarts."""

  def __init__(self, workdir: str, config: dict[str, Any] | None = None):
    try:
      import wandb  # pylint: disable=g-import-not-at-top  (deferred: optional, the wandb extra)
    except ImportError:
      raise ModuleNotFoundError("train.log_to=wandb needs the wandb extra: pip install "
                                "'prism_jax[wandb]'") from None
    id_path = paths.path(paths.join(workdir, RUN_ID_FILE))
    if id_path.exists():
      run_id = id_path.read_text().strip()
    else:
      run_id = secrets.token_hex(4)  # W&B ids: short, [a-z0-9]
      id_path.write_text(run_id + "\n")
    # W&B writes its files locally: beside a local run, in a temp dir for a gs:// one
    local = tempfile.mkdtemp(prefix="prism_wandb_") if paths.is_remote(workdir) else workdir
    self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "prism_jax"), id=run_id,
                          resume="allow", dir=local,
                          name=os.path.basename(paths.resolve(workdir).rstrip("/")),
                          config=config or {})

  def log(self, step: int, split: str, scalars: dict[str, float]) -> None:
    self.run.log({f"{split}/{k}": v for k, v in scalars.items()}, step=int(step))

  def histogram(self, step: int, key: str, counts) -> None:
    """log10(1 + counts) as a W&B histogram at `step` (the report's usage plot)."""
    import wandb  # pylint: disable=g-import-not-at-top  (deferred: optional, the wandb extra)
    values = np.log10(1.0 + np.asarray(counts, np.float64))
    self.run.log({key: wandb.Histogram(np_histogram=np.histogram(values, bins=32))},
                 step=int(step))

  def close(self) -> None:
    self.run.finish()
