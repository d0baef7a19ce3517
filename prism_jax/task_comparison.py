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
import time

import numpy as np
from flax import nnx

from prism_jax.attribution.caching.cache_format import model_fingerprint
from prism_jax.control import controllers as ctl
from prism_jax.control import sae as sae_lib
from prism_jax import bootstrap
from prism_jax.data import batch as batch_lib
from prism_jax.evaluation import scoring, synthetic, tasks
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
  index = bootstrap.bootstrap_index(len(held_items), resamples, seed=0)
  correct = {k: scoring.correct(held_items, v) for k, v in systems.items()}
  row = {"task": items[0].task, "n_items": len(items), "n_calibration": int(len(cal)),
         "n_eval": len(held_items), "chance": chance(held_items),
         "truncated_options": int(enc.truncated_O.sum()),
         "acc": {k: bootstrap.mean_ci(c, index) for k, c in correct.items()}}
  if items[0].task in ACC_NORM_TASKS:
    row["acc_norm"] = {k: bootstrap.mean_ci(scoring.correct(held_items, v, norm=True), index)
                       for k, v in systems.items() if k in ("dense", "prism")}
  pairs = [("prism", "dense"), ("prism+ctrl", "prism"), ("dense+sae_ctrl", "dense")]
  row["delta"] = {f"{a} - {b}": bootstrap.paired_diff_ci(correct[b], correct[a], index)
                  for a, b in pairs if a in correct}
  for name, c in fitted.items():
    if c is not None:
      row[f"{name}_controller_nnz"] = len(c.nonzero())
      row[f"{name}_controller_lam"] = c.lam
  return row, fitted


# The whole comparison over several tasks (`prism evaluate` and experiments call these).

def hidden_states(model, packed, split: str, max_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """(z (N, D), next tokens (N,)): a model's final hidden states on the first `max_rows`
  packed rows of `split`, valid positions only (what the SAE baseline is trained on)."""
  rows = packed.rows(split)
  n = min(max_rows, len(rows["tokens"]))
  b = batch_lib.from_rows(np.asarray(rows["tokens"][:n]), np.asarray(rows["example_id"][:n]),
                          np.asarray(rows["offset"][:n]), np.arange(n))
  fwd = nnx.jit(lambda m, x: m(x).z_BxTxD)
  zs = [np.asarray(fwd(model, b["inputs"][i:i + 16])) for i in range(0, n, 16)]
  mask = b["mask"].reshape(-1)
  return np.concatenate(zs).reshape(-1, zs[0].shape[-1])[mask], b["targets"].reshape(-1)[mask]


@dataclasses.dataclass
class TaskSet:
  """The items of each task, with what fitting them to the context cost."""
  items: dict[str, list[Item]]
  dropped: dict[str, int]  # items dropped as too long (too_long="drop")
  continuation_cut: dict[str, int]  # items scored with a continuation cut to max_len


def load_tasks(names: list[str], packed, tok, max_len: int, *, too_long: str = "truncate",
               synthetic_n: int = 400, limit: int | None = None, seed: int = 0) -> TaskSet:
  """Offline tasks (evaluation/tasks.py) and synthetic ones from the run's val documents
  (evaluation/synthetic.py), fitted to `max_len` as `too_long` says (truncate, drop,
  refuse: scoring.encode_items)."""
  tasks.check_task_names(names, synthetic.SYNTHETIC_TASKS)
  out = TaskSet({}, {}, {})
  for name in names:
    if name in synthetic.SYNTHETIC_TASKS:
      items = synthetic.synthetic_items(name, packed, synthetic_n, seed)
    else:
      items = tasks.load_task(name, limit, seed)
    if too_long == "drop":
      items, out.dropped[name] = scoring.drop_too_long(items, tok, max_len)
    enc = scoring.encode_items(items, tok, max_len,
                               too_long="refuse" if too_long == "refuse" else "truncate")
    out.continuation_cut[name] = int(len(np.unique(enc.item_O[enc.cont_cut_O > 0])))
    out.items[name] = items
  return out


def sae_baseline(dense, packed, num_latents: int, k: int, *, steps: int, seed: int,
                 sae_path: str | None = None) -> tuple[sae_lib.SaeFit, dict]:
  """(the TopK SAE on the dense twin's hidden states, its val metrics): trained on 512
  train rows, or loaded from `sae_path` (an earlier run's sae.npz of the same twin)."""
  if sae_path:
    sae = sae_lib.load_sae(sae_path)
  else:
    x, _ = hidden_states(dense, packed, "train", 512)
    sae = sae_lib.train_sae(x, sae_lib.SaeConfig(num_latents=num_latents, k=k, steps=steps,
                                                 seed=seed))
  xv, tv = hidden_states(dense, packed, "val", 256)
  return sae, sae_lib.sae_metrics(sae, dense, xv, tv)


def evaluate_tasks(task_set: TaskSet, prism, dense, tok, packed, *,
                   setup: ControlSetup | None = None, sae: sae_lib.SaeFit | None = None,
                   progress=None) -> tuple[list[dict], dict, dict]:
  """(rows, controllers, traces): `evaluate_task` on every task of `task_set`; the fitted
  controllers by "<task>.<prism|sae>_controller"; each controller's non-zero weights with
  their prototype's (or SAE latent's) logit signature and top training snippets by
  "<task>/<prism|sae>". `progress(name, seconds)` is called after each task."""
  rows, controllers, traces = [], {}, {}
  d_model = dense.cfg.d_model
  for name, items in task_set.items.items():
    t0 = time.time()
    row, fitted = evaluate_task(items, prism, dense, tok, setup=setup, sae=sae)
    row["seconds"] = round(time.time() - t0, 1)
    row["dropped_too_long"] = task_set.dropped.get(name, 0)
    row["items_with_continuation_cut"] = task_set.continuation_cut[name]
    rows.append(row)
    if progress is not None:
      progress(name, row["seconds"])
    if fitted["prism"] is not None:
      controllers[f"{name}.prism_controller"] = fitted["prism"]
      code_fn = lambda x: (lambda o: (o.protos.idx_Nxk, o.protos.act_Nxk))(prism(x))
      traces[f"{name}/prism"] = ctl.traces(fitted["prism"], prism, prism.bank.protos[...],
                                           tok, packed, code_fn)
    if fitted["sae"] is not None:
      controllers[f"{name}.sae_controller"] = fitted["sae"]
      code_fn = lambda x: sae_lib.encode(sae.params, dense(x).z_BxTxD.reshape(-1, d_model),
                                         sae.cfg.k)
      traces[f"{name}/sae"] = ctl.traces(fitted["sae"], dense, sae.params["W_dec"], tok,
                                         packed, code_fn)
  return rows, controllers, traces
