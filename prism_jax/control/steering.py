"""Steering gains from every form a user gives them, checked in one place (PRISM.md §6).

    gains_vector(K, {7: 2.0, 3: 0.0})        # (K,) float32, 1 where no gain is named
    gains_vector(K, g_K)                      # an array of K gains, checked
    gains_vector(K, ids=[3, 5])               # suppression: 0 on those ids
    gains_vector(K, steering_set=obj, fingerprint=fp)   # a saved set's JSON content
    gain_map(K, ...)                          # the same forms as {prototype id: gain}
    save_set(path, {7: 2.0}); read_set(path)  # the steering-set file (FORMAT)

A gain scales a prototype's share of the logits: 0 removes it, 1 leaves it, > 1 amplifies
it (`model/logit_edit.controlled_logits` applies them). The forms given multiply, and
`gains_vector`'s `base_K` (a steered view's gains so far) multiplies too. A saved set is the
explorer's {"format": FORMAT, "gains": {id: g}, "note": ...} (its page writes the same JSON)
or the set `prism suppress` saves ({"format": SUPPRESSION_FORMAT, "ids": [...],
"fingerprint": {...}}, control/suppression.py's ProtoSet), which holds only for the bank it
was saved from. Every refusal is a one-line ValueError naming the problem; a set saved for
another bank is a ForeignSetError (the explorer answers it with 409).

`Run.steer` / `Run.suppress`, the explorer's requests and engine, `prism generate
--suppress`, the suppression procedures and `prism lm-eval --gains` all build their gains
here (tests/test_one_steering_path.py checks that no other module does).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prism_jax import paths

FORMAT = "prism_jax.steering/1"  # the explorer's saved set (serve/static/app.js writes it)
SUPPRESSION_FORMAT = "prism_jax.suppression_set/1"  # `prism suppress`'s saved ProtoSet
SET_FIELDS = ("format", "gains", "note")
_PROTO_KEY = re.compile(r"\s*[+-]?[0-9]{1,10}\s*")  # ASCII digits: not "5_0" nor "٥"


class ForeignSetError(ValueError):
  """A suppression set saved for another model (its bank fingerprint differs)."""


def proto_id(key, num_prototypes: int) -> int:
  """One prototype id: an integer (or a string of ASCII digits, as JSON keys are) in [0, K)."""
  # int() alone would take 1.7, True, "5_0" and "٥": only an integer or ASCII digits name one
  if isinstance(key, str) and _PROTO_KEY.fullmatch(key):
    i = int(key)
  elif isinstance(key, numbers.Integral) and not isinstance(key, (bool, np.bool_)):
    i = int(key)
  else:
    raise ValueError(f"prototype ids must be integers, got {[str(key)[:40]]}")
  if not 0 <= i < num_prototypes:
    raise ValueError(f"prototype ids must be in [0, {num_prototypes}), got [{i}]")
  return i


def check_ids(ids, num_prototypes: int) -> np.ndarray:
  """`ids` (any sequence or array of integers, repeats allowed) as int64, in their order."""
  if isinstance(ids, (str, bytes, Mapping)):
    raise ValueError(f"prototype ids must be a list of integers, got {str(ids)[:60]!r}")
  try:
    ids_G = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
  except (TypeError, ValueError):
    raise ValueError(f"prototype ids must be a list of integers, got {str(ids)[:60]!r}") from None
  if ids_G.size and (not np.issubdtype(ids_G.dtype, np.integer) or ids_G.dtype == bool):
    raise ValueError(f"prototype ids must be integers, got {ids_G.tolist()[:8]}")
  ids_G = ids_G.astype(np.int64)
  bad = ids_G[(ids_G < 0) | (ids_G >= num_prototypes)]
  if bad.size:
    raise ValueError(f"prototype ids must be in [0, {num_prototypes}), got {bad.tolist()[:8]}")
  return ids_G


def check_fingerprint(saved, have: Mapping, what: str) -> None:
  """Refuses a set whose saved bank fingerprint differs from this model's (`have`)."""
  if not isinstance(saved, Mapping):
    raise ValueError(f"{what}'s fingerprint must be a JSON object")
  diff = [k for k in have if saved.get(k) != have[k]]
  if diff:
    raise ForeignSetError(f"{what} was saved for another model: {', '.join(diff)} differ "
                          "from this model's")


def _gain(i: int, g, gain_max: float) -> float:
  if isinstance(g, (bool, np.bool_)) or not isinstance(g, numbers.Real):
    raise ValueError(f"the gain of prototype {i} must be a number, got {str(g)[:40]!r}")
  g = float(g)
  if not (math.isfinite(g) and 0.0 <= g <= gain_max):
    bound = ">= 0" if gain_max == math.inf else f"in [0, {gain_max:g}]"
    raise ValueError(f"gains must be finite and {bound}: prototype {i} has {g:g}")
  return g


def _named(raw, num_prototypes: int, gain_max: float) -> dict[int, float]:
  """{id: gain} of a {prototype id: gain} mapping (keys: integers or ASCII-digit strings)."""
  if not isinstance(raw, Mapping):
    raise ValueError("gains must be an object {prototype id: gain}")
  if len(raw) > num_prototypes:
    raise ValueError(f"gains has {len(raw)} entries, the bank has {num_prototypes} prototypes")
  out: dict[int, float] = {}
  named: dict[int, str] = {}
  for key, g in raw.items():
    i = proto_id(key, num_prototypes)
    if i in named:  # "5" and "05" are distinct keys naming one prototype: which gain holds?
      raise ValueError(f"gains names prototype {i} twice ({named[i][:20]!r} and "
                       f"{str(key)[:20]!r})")
    named[i] = str(key)
    out[i] = _gain(i, g, gain_max)
  return out


def _saved_set(obj, num_prototypes: int, fingerprint, gain_max: float) -> dict[int, float]:
  """{id: gain} of a saved set's JSON content: the explorer's or `prism suppress`'s."""
  if isinstance(obj, str):
    raise ValueError("steering_set must be the set's JSON content, not a path or name")
  if not isinstance(obj, Mapping):
    raise ValueError("steering_set must be a JSON object")
  if obj.get("format") == SUPPRESSION_FORMAT:
    if fingerprint is None:
      raise ValueError("a suppression set needs the model's fingerprint to be checked")
    check_fingerprint(obj.get("fingerprint", {}), fingerprint, "this suppression set")
    ids = obj.get("ids")
    if not isinstance(ids, list):
      raise ValueError("suppression set has no list of ids")
    return {proto_id(i, num_prototypes): 0.0 for i in ids}
  unknown = sorted(set(obj) - set(SET_FIELDS))
  if unknown:
    raise ValueError(f"unknown field {str(unknown[0])[:40]!r} in a steering set; allowed: "
                     f"{', '.join(SET_FIELDS)}")
  if obj.get("format", FORMAT) != FORMAT:
    raise ValueError(f"unknown steering set format {str(obj.get('format'))[:60]!r}")
  return _named(obj.get("gains", {}), num_prototypes, gain_max)


def gain_map(num_prototypes: int, gains: Mapping | None = None, *,
             ids: Sequence[int] | None = None, steering_set=None,
             fingerprint: Mapping | None = None,
             gain_max: float = math.inf) -> dict[int, float]:
  """{prototype id: gain} for the ids the given forms name (the forms multiply).

  Args:
    num_prototypes: K, the size of the bank; every id must be in [0, K).
    gains: {prototype id: gain}; ids are integers or strings of ASCII digits (JSON keys),
      two keys naming one prototype ("5" and "05") are refused.
    ids: prototype ids to remove (gain 0); repeats allowed.
    steering_set: a saved set's JSON content (module doc), never a path.
    fingerprint: the model's `suppression.model_fingerprint`, which a suppression set must
      match (ForeignSetError otherwise).
    gain_max: the largest gain accepted in `gains` and a set's gains (the explorer's bound).

  Returns:
    {id: gain}, gains as Python floats; ids no form names are absent (gain 1).
  """
  out = {} if gains is None else _named(gains, num_prototypes, gain_max)
  extra = [] if ids is None else [{int(i): 0.0 for i in check_ids(ids, num_prototypes)}]
  if steering_set is not None:
    extra.append(_saved_set(steering_set, num_prototypes, fingerprint, gain_max))
  for part in extra:
    for i, g in part.items():
      out[i] = out.get(i, 1.0) * g
  return out


def gains_vector(num_prototypes: int, gains=None, *, ids: Sequence[int] | None = None,
                 steering_set=None, fingerprint: Mapping | None = None,
                 gain_max: float = math.inf, base_K=None) -> np.ndarray:
  """The (K,) float32 gains of any accepted form: 1 where none is named.

  Args:
    num_prototypes: K.
    gains: {prototype id: gain} (as `gain_map`) or an array of K gains.
    ids: prototype ids to remove (gain 0), as `gain_map`.
    steering_set: a saved set's JSON content, as `gain_map`.
    fingerprint: the model's fingerprint a suppression set must match, as `gain_map`.
    gain_max: the largest gain accepted (the array's entries included).
    base_K: gains these multiply (a steered view's so far), or None.

  Returns:
    A NumPy float32 array of shape (K,), every entry finite and >= 0.
  """
  g_K = np.ones(num_prototypes, np.float32) if base_K is None else np.array(base_K, np.float32)
  if g_K.shape != (num_prototypes,):
    raise ValueError(f"base gains must have shape ({num_prototypes},), got {g_K.shape}")
  if gains is not None and not isinstance(gains, Mapping):
    try:
      arr_K = np.asarray(gains, np.float32)
    except (TypeError, ValueError):
      arr_K = np.zeros(0)
    if arr_K.shape != (num_prototypes,):
      raise ValueError(f"gains must be a {{prototype id: gain}} dict or an array of shape "
                       f"({num_prototypes},), got {np.shape(gains)}")
    bad = np.flatnonzero(~(np.isfinite(arr_K) & (arr_K >= 0) & (arr_K <= gain_max)))
    if bad.size:
      _gain(int(bad[0]), float(arr_K[bad[0]]), gain_max)  # raises, naming the first
    g_K = g_K * arr_K
    gains = None
  for i, g in gain_map(num_prototypes, gains, ids=ids, steering_set=steering_set,
                       fingerprint=fingerprint, gain_max=gain_max).items():
    g_K[i] *= g
  if not np.all(np.isfinite(g_K)) or (g_K < 0).any():
    raise ValueError("gains must be finite and >= 0 (the base gains are not)")
  return g_K


def suppression_gains(num_prototypes: int, proto_ids: Sequence[int]) -> jax.Array:
  """Gain vector (K,) that is 0 on `proto_ids` and 1 elsewhere: suppression of a set G.

  Args:
    num_prototypes: K, the size of the bank.
    proto_ids: the prototype ids of G, integers in [0, K) (repeats allowed; empty gives
      all ones). A ValueError for non-integers or ids out of range.

  Returns:
    A float32 jax array of shape (K,): 0.0 at `proto_ids`, 1.0 elsewhere.
  """
  return jnp.asarray(gains_vector(num_prototypes, ids=proto_ids))


def read_set(path: str) -> dict:
  """A steering-set file's JSON content (local or gs://), for `gain_map(steering_set=)`."""
  if not paths.path(path).is_file():
    raise FileNotFoundError(f"steering set file {path} does not exist")
  obj = json.loads(paths.path(path).read_text())  # a JSONDecodeError is a ValueError
  if not isinstance(obj, dict):
    raise ValueError(f"steering set file {path} does not hold a JSON object")
  return obj


def save_set(path: str, gains: Mapping, num_prototypes: int, note: str | None = None) -> str:
  """Writes {prototype id: gain} as the explorer's steering set (FORMAT) at `path`."""
  checked = _named(gains, num_prototypes, math.inf)
  obj = {"format": FORMAT, "gains": {str(i): g for i, g in sorted(checked.items())},
         **({"note": note} if note else {})}
  paths.write_text_atomic(path, json.dumps(obj, indent=2))
  return path
