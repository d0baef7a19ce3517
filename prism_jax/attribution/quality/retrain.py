"""Retrain the model on a subset of the packed training rows (LDS and removal curves).

`retrain(cfg, packed, rows, seed)` runs the model's own recipe (PRISM.md §3), the one
`train()` runs (prism_jax/train/recipe.py: the born-sharded init from `seed`, the dense
warm-up, the bank set by k-means++ at `train.proto_init_step`, revival, the same optimiser
and schedule), through the shared loop (`train/engine.Loop`). Only the data
differs: batch s is drawn from `rows` alone, a pure function of (seed, s) (each epoch a
fresh permutation of the kept rows; a short last batch is dropped), so a retrain is
reproducible and two seeds differ in both the init and the order.

`measure(model, queries)` is the counterfactual measurement: each query's summed CE on its
target tokens (losses.token_nll, the one per-token CE).

`RetrainStore` keeps one small .npz per finished retrain (its measurements), under a name,
in a directory claimed by a content key (`content_key`: hashes of the training rows and the
queries, the whole config, the protocol's settings, the code commit): a rerun with the same
key skips what is done, so an interrupted sweep resumes; a rerun with another key is
refused with one line naming what differs (`claim_key`), so stale retrains never mix in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import io

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax import losses, paths
from prism_jax.config import Config
from prism_jax.data import batch as batch_lib
from prism_jax.train import step as step_lib
from prism_jax.train import engine
from prism_jax.train.recipe import Recipe
from prism_jax.train.state import default_mesh


# A sweep of retrains of one config compiles once: its Recipe (template, shardings, the
# phases' jitted steps) and initial state are kept for the most recent configs (a sweep
# retrains one config hundreds of times; a few configs at most alternate).
@functools.lru_cache(maxsize=2)
def _recipe(cfg: Config):
  """(recipe, initial state) of `cfg` on one device (the seed is in cfg)."""
  recipe = Recipe(cfg, default_mesh(cfg, jax.devices()[:1]))  # retrains are small
  with jax.set_mesh(recipe.mesh):
    return recipe, recipe.init_state()


class SubsetBatches:
  """Global batches of `batch_size` rows drawn from `rows` only: batch s = f(seed, s)."""

  def __init__(self, packed, rows: np.ndarray, batch_size: int, seed: int):
    rows = np.unique(np.asarray(rows, np.int64))
    if len(rows) < batch_size:
      raise ValueError(f"a subset of {len(rows)} rows cannot fill a batch of {batch_size}")
    if rows[0] < 0 or rows[-1] >= packed.num_rows("train"):
      raise ValueError(f"subset rows must be in [0, {packed.num_rows('train')}), got "
                       f"{rows[0]}..{rows[-1]}")
    self.rows, self.batch_size, self.seed = rows, batch_size, seed
    self.per_epoch = len(rows) // batch_size
    self._data = packed.rows("train")
    self._perm: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._perm:
      self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.rows)}
    return self._perm[epoch]

  def global_batch_at(self, step: int) -> dict[str, np.ndarray]:
    epoch, i = divmod(step, self.per_epoch)
    sel = np.sort(self._order(epoch)[i * self.batch_size:(i + 1) * self.batch_size])
    d = self._data
    return batch_lib.from_rows(np.asarray(d["tokens"][sel]), np.asarray(d["example_id"][sel]),
                               np.asarray(d["offset"][sel]), sel.astype(np.int32))


def retrain(cfg: Config, packed, rows, seed: int, *, progress: bool = False):
  """(model, final train metrics): `cfg`'s recipe trained from `seed` on training `rows`."""
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=int(seed)))
  tc = cfg.train
  recipe, init = _recipe(cfg)
  recipe.restore_bank_state({})  # a shared recipe: "auto" finds this retrain's own init step
  source = SubsetBatches(packed, rows, tc.batch_size, seed)
  with jax.set_mesh(recipe.mesh):
    state = jax.tree.map(jnp.copy, init)  # the step donates its state: keep the cached one
    loop = engine.Loop(start=0, steps=tc.steps, log_every=tc.log_every if progress
                        else tc.steps)

    def before_step(s, state):  # THE recipe's bank init and revival (train/recipe.py)
      if not recipe.due(s):
        return state
      loop.flush()
      return recipe.before_step(s, state, source)[0]

    batches = (step_lib.device_batch(source.global_batch_at(s), recipe.mesh, tc.batch_size)
               for s in range(tc.steps))
    out = loop.run(state, batches, recipe.step_for, before_step=before_step)
  return nnx.merge(recipe.graphdef, out.state.params), dict(out.train)


@dataclasses.dataclass(frozen=True)
class Queries:
  """Query rows (L = T + 1 tokens each) and their target positions as a (Q, T) mask over
  the targets row[1:] (position p of the row is target column p - 1)."""

  tokens_QxL: np.ndarray
  mask_QxT: np.ndarray

  def __post_init__(self):
    if self.tokens_QxL.ndim != 2 or self.mask_QxT.shape != (self.tokens_QxL.shape[0],
                                                            self.tokens_QxL.shape[1] - 1):
      raise ValueError(f"queries need (Q, L) tokens and a (Q, L-1) mask, got "
                       f"{self.tokens_QxL.shape} and {self.mask_QxT.shape}")
    if not np.all(self.mask_QxT.any(1)):
      raise ValueError("every query needs at least one target position")

  @property
  def positions(self) -> list[list[int]]:
    """Per query the row positions p predicted (attribution's target_positions)."""
    return [list(np.flatnonzero(m) + 1) for m in self.mask_QxT]

  def batch(self) -> dict[str, np.ndarray]:
    return batch_lib.next_token(self.tokens_QxL, self.mask_QxT)


def sample_queries(packed, num: int, targets: int, seed: int) -> tuple[list[int], Queries]:
  """(val row ids, Queries): the first `num` validation rows of a seeded permutation that
  have `targets` target tokens with a real prediction, `targets` of them drawn per row (the
  LDS protocol's queries; the cost bench draws the same ones)."""
  rows = packed.rows("val")
  rng = np.random.default_rng(seed)
  picked, masks = [], []
  for r in rng.permutation(packed.num_rows("val")):
    valid = np.flatnonzero(rows["offset"][r, 1:] > 0)  # target columns with a real prediction
    if len(valid) < targets:
      continue
    mask = np.zeros(packed.seq_len, bool)
    mask[rng.choice(valid, targets, replace=False)] = True
    picked.append(int(r))
    masks.append(mask)
    if len(picked) == num:
      break
  if len(picked) < num:
    raise ValueError(f"--queries={num}: only {len(picked)} validation rows have "
                     f"{targets} target tokens")
  return picked, Queries(np.asarray(rows["tokens"][picked]), np.stack(masks))


@nnx.jit
def _summed_loss(model, inputs_QxT, targets_QxT, mask_QxT):
  out = model(inputs_QxT, mask_BxT=mask_QxT)
  nll_QxT = losses.token_nll(out.logits_BxTxV, targets_QxT)
  return jnp.sum(nll_QxT * mask_QxT.astype(nll_QxT.dtype), axis=1)


def measure(model, queries: Queries) -> np.ndarray:
  """(Q,) float64: each query's summed CE on its target tokens under `model`."""
  b = queries.batch()
  return np.asarray(_summed_loss(model, jnp.asarray(b["inputs"], jnp.int32),
                                 jnp.asarray(b["targets"], jnp.int32),
                                 jnp.asarray(b["mask"])), np.float64)


def _digest(*arrays: np.ndarray) -> str:
  h = hashlib.sha256()
  for a in arrays:
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def content_key(train_tokens_ExL: np.ndarray, queries: Queries, cfg: Config, commit: str,
                protocol: dict | None = None) -> dict:
  """What stored retrains and scores depend on: the training rows' and the queries' content
  (sha256), every config value, the protocol's own settings (subset seed, α, ...) and the
  code commit (with a hash of uncommitted changes, as the caller's provenance gives it)."""
  return {"rows": _digest(np.asarray(train_tokens_ExL)),
          "queries": _digest(queries.tokens_QxL, queries.mask_QxT),
          "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
          "protocol": dict(protocol or {}), "commit": str(commit)}


def key_hash(key: dict) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _differences(there: dict, here: dict) -> list[str]:
  out = []
  for part in ("rows", "queries", "commit"):
    if there.get(part) != here.get(part):
      out.append(f"{part} {str(there.get(part))[:12]} there, {str(here.get(part))[:12]} here")
  for part in ("config", "protocol"):
    prefix = "" if part == "config" else f"{part}."  # config keys read loss.x, model.x
    a, b = _flat(there.get(part, {}), prefix), _flat(here.get(part, {}), prefix)
    out += [f"{k} {a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
  return out


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


class KeyMismatchError(ValueError):
  """A directory holds results of another recipe, data, query set or code."""


def claim_key(directory: str, key: dict) -> None:
  """Writes <directory>/KEY.json for `key`, or checks the one there; a different key is
  refused with one line naming what differs (nothing in the directory is touched)."""
  path = paths.join(paths.resolve(directory), "KEY.json")
  p = paths.path(path)
  if not p.exists() and p.parent.exists() and any(p.parent.iterdir()):
    raise KeyMismatchError(f"{directory} holds results written without a content key (an "
                           "older run): their recipe is unknown; use another --out or "
                           "delete that directory")
  if p.exists():
    there = json.loads(p.read_text())
    if key_hash(there) != key_hash(key):
      diff = _differences(there, key)
      raise KeyMismatchError(
          f"{directory} holds results of another recipe ({'; '.join(diff[:4])}"
          f"{f'; and {len(diff) - 4} more' if len(diff) > 4 else ''}): resuming would mix "
          "them in; use another --out or delete that directory")
    return
  p.parent.mkdir(parents=True, exist_ok=True)
  paths.write_text_atomic(path, json.dumps(key, indent=1, sort_keys=True))


class RetrainStore:
  """<dir>/<name>.npz per finished retrain: {"loss_Q", "rows", "seed"} (+ meta JSON), in a
  directory claimed by `key` (claim_key)."""

  def __init__(self, directory: str, key: dict):
    self.directory = paths.resolve(directory)  # local or gs://
    paths.path(self.directory).mkdir(parents=True, exist_ok=True)
    claim_key(self.directory, key)

  def path(self, name: str) -> str:
    return paths.join(self.directory, f"{name}.npz")

  def has(self, name: str) -> bool:
    return paths.path(self.path(name)).exists()

  def load(self, name: str) -> np.ndarray:
    with np.load(io.BytesIO(paths.path(self.path(name)).read_bytes())) as f:
      return np.asarray(f["loss_Q"], np.float64)

  def run(self, name: str, cfg: Config, packed, rows, seed: int, queries: Queries
          ) -> np.ndarray:
    """The measurements of retrain `name` (trained now unless already stored)."""
    if self.has(name):
      return self.load(name)
    model, metrics = retrain(cfg, packed, rows, seed)
    loss_Q = measure(model, queries)
    buf = io.BytesIO()
    np.savez(buf, loss_Q=loss_Q, rows=np.asarray(rows, np.int64), seed=seed)
    # atomic: a killed run never leaves half a result
    paths.write_bytes_atomic(self.path(name), buf.getvalue())
    paths.write_text_atomic(paths.join(self.directory, f"{name}.json"), json.dumps(
        {"seed": int(seed), "num_rows": int(len(rows)), "train": metrics}))
    return loss_Q
