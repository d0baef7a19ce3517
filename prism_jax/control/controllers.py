"""Sparse linear controllers over a sparse code of the final hidden state (PRISM.md §6):
a PrismLM's active prototypes (a_{t,i}, p_i), or a TopK SAE's latents on the dense twin
(s_{t,j}, d_j). Two kinds, both L1-regularised and fit on a seeded calibration split:

  gains   ℓ'_t = ℓ_t + Σ_{j∈S_t} w_j c_{t,j} W d_j on the continuation tokens (the edit of
          model/logit_edit.py's code_logits), option score = Σ_t log softmax(ℓ'_t)[y_t]
  linear  score'_o = score_o + Σ_j w_j Σ_{t∈o} c_{t,j}: a sparse linear map from the active
          codes' activations to the option scores

The fit minimises the options' cross-entropy (softmax over an item's option scores against
its gold) + λ||w||₁ with proximal Adam (prox_adam: the soft-threshold in Adam's metric),
so unused weights are exactly 0; it runs on train/engine.py's shared Trainer. A controller records the
fingerprint of the model (and SAE) it was fit on and refuses any other.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from prism_jax.losses import token_nll
from prism_jax.model.logit_edit import code_logits
from prism_jax.train.engine import Trainer

KINDS = ("gains", "linear")


# What a controller reads of evaluation's items and scores, stated here so that control and
# evaluation stay independent layers (evaluation.tasks.Item and evaluation.scoring.Scores
# satisfy these).
class Item(Protocol):
  num_options: int
  gold: int


class Scores(Protocol):
  logprob_O: Any       # (O,) option log-likelihoods
  option_C: Any        # (C,) option of each continuation token (None: not collected)
  logits_CxV: Any
  targets_C: Any
  idx_Cxk: Any         # the active prototypes of each continuation token
  act_Cxk: Any


class ControllerMismatchError(ValueError):
  """A controller applied to a model (or SAE) other than the one it was fit on."""


@dataclasses.dataclass
class CodeData:
  """Everything a controller needs about a set of items' options, from one scoring pass:
  the unedited option scores and, per continuation token, logits, target, option and code."""
  items: list[Item]
  logprob_O: np.ndarray
  option_C: np.ndarray
  logits_CxV: np.ndarray
  targets_C: np.ndarray
  idx_Cxk: np.ndarray
  coef_Cxk: np.ndarray

  def subset(self, item_ids: Sequence[int]) -> "CodeData":
    starts = np.concatenate([[0], np.cumsum([it.num_options for it in self.items])])
    opts = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in item_ids])
    new_of_old = np.full(len(self.logprob_O), -1)
    new_of_old[opts] = np.arange(len(opts))
    rows = np.flatnonzero(np.isin(self.option_C, opts))
    rows = rows[np.argsort(new_of_old[self.option_C[rows]], kind="stable")]
    return CodeData([self.items[i] for i in item_ids], self.logprob_O[opts],
                    new_of_old[self.option_C[rows]], self.logits_CxV[rows],
                    self.targets_C[rows], self.idx_Cxk[rows], self.coef_Cxk[rows])


def code_data(items: list[Item], scores: Scores, idx_Cxk=None, coef_Cxk=None) -> CodeData:
  """From a `score_options(..., collect=True)` pass: the PrismLM's prototype code by
  default, or a given code (an SAE's latents on scores.z_CxD)."""
  if scores.option_C is None:
    raise ValueError("controllers need the continuation tokens: score with collect=True")
  idx = scores.idx_Cxk if idx_Cxk is None else idx_Cxk
  coef = scores.act_Cxk if coef_Cxk is None else coef_Cxk
  if idx is None:
    raise ValueError("a dense model has no prototype code: pass an SAE's (idx, coef)")
  return CodeData(list(items), scores.logprob_O, scores.option_C, scores.logits_CxV,
                  scores.targets_C, np.asarray(idx), np.asarray(coef, np.float32))


def calibration_split(n: int, fraction: float = 0.5, seed: int = 0):
  """(calibration ids, held-out ids), sorted, from a seeded permutation."""
  if not 0 < fraction < 1:
    raise ValueError(f"calibration fraction must be in (0, 1), got {fraction}")
  perm = np.random.default_rng(seed).permutation(n)
  cut = max(1, min(n - 1, int(round(fraction * n))))
  return np.sort(perm[:cut]), np.sort(perm[cut:])


def _layout(items: list[Item]):
  """(option index per item slot (I, Omax), valid mask, gold (I,)); pads point at 0."""
  o_max = max(it.num_options for it in items)
  slot = np.zeros((len(items), o_max), np.int32)
  valid = np.zeros((len(items), o_max), bool)
  start = 0
  for i, it in enumerate(items):
    slot[i, :it.num_options] = np.arange(start, start + it.num_options)
    valid[i, :it.num_options] = True
    start += it.num_options
  return slot, valid, np.asarray([it.gold for it in items], np.int32)


@dataclasses.dataclass
class SparseController:
  """w over the K codes of a basis ('prism' prototypes or 'sae' latents)."""
  kind: str
  basis: str
  w_K: np.ndarray
  fingerprint: str
  lam: float

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown controller kind {self.kind!r}: use one of {KINDS}")

  def check(self, fingerprint: str) -> None:
    if fingerprint != self.fingerprint:
      raise ControllerMismatchError(
          f"this {self.basis} controller was fit on model {self.fingerprint[:12]}…, not on "
          f"{fingerprint[:12]}…: refit it on this model (--controller_fit)")

  def nonzero(self) -> list[tuple[int, float]]:
    ids = np.flatnonzero(self.w_K)
    return [(int(i), float(self.w_K[i])) for i in ids[np.argsort(-np.abs(self.w_K[ids]))]]

  def save(self, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"kind": self.kind, "basis": self.basis, "fingerprint": self.fingerprint,
                 "lam": self.lam, "w": self.w_K.tolist()}, f)

  @classmethod
  def load(cls, path: str) -> "SparseController":
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
    return cls(d["kind"], d["basis"], np.asarray(d["w"], np.float32), d["fingerprint"],
               d["lam"])


def _score_fn(kind: str, model, dict_KxD, data: CodeData):
  """score_O(w) (jnp) for the data's options under controller weights w."""
  num_opts = len(data.logprob_O)
  option_C = jnp.asarray(data.option_C)
  idx, coef = jnp.asarray(data.idx_Cxk), jnp.asarray(data.coef_Cxk)
  base_O = jnp.asarray(data.logprob_O, jnp.float32)
  if kind == "linear":
    feat_OxK = jnp.zeros((num_opts, dict_KxD.shape[0])).at[option_C[:, None], idx].add(coef)
    return lambda w: base_O + feat_OxK @ w
  logits, targets = jnp.asarray(data.logits_CxV), jnp.asarray(data.targets_C)
  dict_KxD = jnp.asarray(dict_KxD)

  def score(w):
    edited_CxV = logits + code_logits(model, dict_KxD, idx, w[idx] * coef)
    logp_C = -token_nll(edited_CxV, targets)
    return jax.ops.segment_sum(logp_C, option_C, num_segments=num_opts)
  return score


class _ProxAdamState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any


def prox_adam(lr: float, lam: float, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-8) -> optax.GradientTransformation:
  """Adam on the data term with the L1 proximal step taken in Adam's own metric:
  w ← soft(w − lr m̂/d, lr λ/d), d = √v̂ + eps. A weight stays exactly 0 while
  |m̂| < λ, so λ is on the gradient's scale (plain Adam + a fixed threshold lr·λ would
  not sparsify: Adam's steps are ~lr whatever the gradient's size)."""
  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # two buffers: the step donates
    return _ProxAdamState(jnp.zeros((), jnp.int32), zeros(), zeros())

  def update(grads, state, params):
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    t = count.astype(jnp.float32)

    def step(p, m, v):
      d = jnp.sqrt(v / (1 - b2 ** t)) + eps
      x = p - lr * (m / (1 - b1 ** t)) / d
      return jnp.sign(x) * jnp.maximum(jnp.abs(x) - lr * lam / d, 0.0) - p
    return jax.tree.map(step, params, mu, nu), _ProxAdamState(count, mu, nu)
  return optax.GradientTransformation(init, update)


def fit_controller(kind: str, basis: str, model, dict_KxD, data: CodeData, fingerprint: str,
                   *, lam: float = 1e-3, lr: float = 0.05, steps: int = 200,
                   log_every: int = 50) -> SparseController:
  """Full-batch fit of w on the calibration data (Adam + L1 proximal step)."""
  if lam < 0:
    raise ValueError(f"lam must be >= 0, got {lam}")
  score = _score_fn(kind, model, dict_KxD, data)
  slot, valid, gold = (jnp.asarray(a) for a in _layout(data.items))

  def loss_fn(params, batch):
    del batch
    s_IxO = jnp.where(valid, score(params["w"])[slot], -jnp.inf)
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(s_IxO, -1), gold[:, None], 1))
    w = params["w"]
    return ce, {"ce": ce, "nnz": jnp.sum(w != 0).astype(jnp.float32),
                "objective": ce + lam * jnp.sum(jnp.abs(w))}

  tx = prox_adam(lr, lam)
  result = Trainer(loss_fn, tx).fit({"w": jnp.zeros(dict_KxD.shape[0], jnp.float32)},
                                    itertools.repeat({}), steps=steps, log_every=log_every)
  w = np.asarray(result.state.params["w"], np.float32)
  return SparseController(kind, basis, w, fingerprint, lam)


def controlled_scores(ctrl: SparseController, model, dict_KxD, data: CodeData,
                      fingerprint: str) -> np.ndarray:
  """Option scores of `data` under the controller (refused on another model)."""
  ctrl.check(fingerprint)
  if ctrl.w_K.shape != (dict_KxD.shape[0],):
    raise ControllerMismatchError(f"controller has {ctrl.w_K.shape[0]} weights, the basis "
                                  f"{dict_KxD.shape[0]} codes")
  score = _score_fn(ctrl.kind, model, dict_KxD, data)
  return np.asarray(jax.jit(score)(jnp.asarray(ctrl.w_K)), np.float64)


def code_signatures(model, dict_KxD) -> np.ndarray:
  """W d_j for every code j, (K, V): what each prototype / latent adds to the logits."""
  num = dict_KxD.shape[0]
  return np.asarray(code_logits(model, dict_KxD, jnp.arange(num)[:, None],
                                jnp.ones((num, 1), jnp.float32)))


def traces(ctrl: SparseController, model, dict_KxD, tok, packed, code_fn, *,
           top_tokens: int = 5, snippets: int = 2, rows: int = 32, width: int = 10) -> list[dict]:
  """Every non-zero weight with its code's logit signature (top tokens of W d_j) and the
  training snippets where the code fires most strongly (`code_fn(inputs_BxT) -> (idx_Nxk,
  coef_Nxk)` over the first `rows` packed training rows; the token in [[ ]])."""
  nz = ctrl.nonzero()
  if not nz:
    return []
  sig_KxV = code_signatures(model, dict_KxD)
  data = packed.rows("train")
  rows = min(rows, len(data["tokens"]))
  idx_Nxk, coef_Nxk = (np.asarray(a) for a in code_fn(np.asarray(data["tokens"][:rows, :-1])))
  ex_N = np.asarray(data["example_id"][:rows, :-1]).reshape(-1)
  off_N = np.asarray(data["offset"][:rows, :-1]).reshape(-1)
  out = []
  for j, w in nz:
    fire_N = np.where((idx_Nxk == j) & (off_N[:, None] >= 0), coef_Nxk, 0.0).sum(1)
    best = [n for n in np.argsort(-fire_N)[:snippets] if fire_N[n] > 0]
    out.append({"code": j, "weight": w,
                "signature": [tok.decode([int(v)]) for v in np.argsort(-sig_KxV[j])[:top_tokens]],
                "snippets": [packed.snippet(int(ex_N[n]), int(off_N[n]), width) for n in best]})
  return out


def select_and_fit(kind: str, basis: str, model, dict_KxD, data: CodeData, fingerprint: str,
                   *, lams: Sequence[float], seed: int = 0, **fit_kw) -> SparseController:
  """λ by a seeded inner split of the calibration items (fit on half, accuracy on the other
  half; ties go to the larger λ, the sparser map), then the fit on all of them."""
  lams = sorted(float(x) for x in lams)
  if not lams:
    raise ValueError("lams must hold at least one L1 weight")
  if len(lams) > 1:
    fit_ids, val_ids = calibration_split(len(data.items), 0.5, seed + 1)
    fit_data, val_data = data.subset(fit_ids), data.subset(val_ids)
    slot, valid, gold = _layout(val_data.items)
    best = (-1.0, None)
    for lam in lams:
      c = fit_controller(kind, basis, model, dict_KxD, fit_data, fingerprint, lam=lam, **fit_kw)
      s_IxO = np.where(valid, controlled_scores(c, model, dict_KxD, val_data,
                                                fingerprint)[slot], -np.inf)
      acc = float(np.mean(np.argmax(s_IxO, 1) == gold))
      if acc >= best[0]:
        best = (acc, lam)
    lams = [best[1]]
  return fit_controller(kind, basis, model, dict_KxD, data, fingerprint, lam=lams[0], **fit_kw)
