"""One task, four systems on the same held-out items: dense, PRISM, PRISM + sparse prototype
controller, dense + SAE-latent controller; accuracies with paired-bootstrap 95% CIs.

The controllers are fit on a seeded calibration split of the items; every accuracy is
measured on the rest (the held-out split), so the four columns are paired item by item.
This module joins control (the controllers) and evaluation (the scoring harness): it stands
one layer above both, which stay independent of each other (.importlinter).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from prism_jax.attribution.caching.cache_format import model_fingerprint
from prism_jax.control import controllers as ctl
from prism_jax.control import sae as sae_lib
from prism_jax import stats
from prism_jax.evaluation import scoring
from prism_jax.evaluation.tasks import ACC_NORM_TASKS, Item, chance


@dataclasses.dataclass
class ControlSetup:
  kind: str = "gains"  # controllers.KINDS
  lams: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2)  # picked on an inner calibration split
  lr: float = 0.05
  steps: int = 200
  cal_fraction: float = 0.5
  seed: int = 0


def sae_model_fingerprint(dense, fit: sae_lib.SaeFit) -> str:
  """The SAE controller's identity: the dense model and the SAE together."""
  return hashlib.sha256((model_fingerprint(dense) + sae_lib.sae_fingerprint(fit.params))
                        .encode()).hexdigest()


def _fit_kw(setup: ControlSetup) -> dict:
  return {"lams": setup.lams, "seed": setup.seed, "lr": setup.lr, "steps": setup.steps,
          "log_every": setup.steps}


def _held(items, held, scores_O):
  per = scoring.per_item(items, scores_O)
  return np.concatenate([per[i] for i in held])


def evaluate_task(items: list[Item], prism, dense, tok, *, setup: ControlSetup | None = None,
                  sae: sae_lib.SaeFit | None = None, batch_rows: int = 32,
                  resamples: int = 2000) -> tuple[dict, dict]:
  """(row, controllers): the row's accuracies (held-out items) with CIs, and the fitted
  controllers {'prism': ..., 'sae': ...} (None when `setup` is None)."""
  if prism.cfg.max_len != dense.cfg.max_len:
    raise ValueError(f"PRISM max_len {prism.cfg.max_len} != dense {dense.cfg.max_len}: "
                     "compare twins of one config")
  enc = scoring.encode_items(items, tok, prism.cfg.max_len)
  collect = setup is not None
  sp = scoring.score_options(prism, enc, batch_rows=batch_rows, collect=collect)
  sd = scoring.score_options(dense, enc, batch_rows=batch_rows, collect=collect and sae is not None)
  if collect:
    cal, held = ctl.calibration_split(len(items), setup.cal_fraction, setup.seed)
  else:
    cal, held = np.zeros(0, int), np.arange(len(items))
  held_items = [items[i] for i in held]
  systems = {"dense": _held(items, held, sd.logprob_O), "prism": _held(items, held, sp.logprob_O)}
  fitted = {"prism": None, "sae": None}
  if collect:
    protos = prism.bank.protos[...]
    data = ctl.code_data(items, sp)
    fp = model_fingerprint(prism)
    fitted["prism"] = ctl.select_and_fit(setup.kind, "prism", prism, protos, data.subset(cal),
                                         fp, **_fit_kw(setup))
    systems["prism+ctrl"] = ctl.controlled_scores(fitted["prism"], prism, protos,
                                                  data.subset(held), fp)
    if sae is not None:
      idx, s = sae_lib.encode(sae.params, sd.z_CxD, sae.cfg.k)
      data = ctl.code_data(items, sd, idx, s)
      fp = sae_model_fingerprint(dense, sae)
      w_dec = sae.params["W_dec"]
      fitted["sae"] = ctl.select_and_fit(setup.kind, "sae", dense, w_dec, data.subset(cal), fp,
                                         **_fit_kw(setup))
      systems["dense+sae_ctrl"] = ctl.controlled_scores(fitted["sae"], dense, w_dec,
                                                        data.subset(held), fp)
  index = stats.bootstrap_index(len(held_items), resamples, seed=0)
  correct = {k: scoring.correct(held_items, v) for k, v in systems.items()}
  row = {"task": items[0].task, "n_items": len(items), "n_calibration": int(len(cal)),
         "n_eval": len(held_items), "chance": chance(held_items),
         "truncated_options": int(enc.truncated_O.sum()),
         "acc": {k: stats.mean_ci(c, index) for k, c in correct.items()}}
  if items[0].task in ACC_NORM_TASKS:
    row["acc_norm"] = {k: stats.mean_ci(scoring.correct(held_items, v, norm=True), index)
                       for k, v in systems.items() if k in ("dense", "prism")}
  pairs = [("prism", "dense"), ("prism+ctrl", "prism"), ("dense+sae_ctrl", "dense")]
  row["delta"] = {f"{a} - {b}": stats.paired_diff_ci(correct[b], correct[a], index)
                  for a, b in pairs if a in correct}
  for name, c in fitted.items():
    if c is not None:
      row[f"{name}_controller_nnz"] = len(c.nonzero())
      row[f"{name}_controller_lam"] = c.lam
  return row, fitted
