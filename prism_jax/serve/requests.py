"""The explorer's request checks: every bound in one place, each refusal one line.

A request body is a JSON object with known fields only (an unknown field, a path among them,
is refused by name); strings are UTF-8; numbers are finite and inside LIMITS. The parse itself
is bounded: nesting at most LIMITS["json_depth"] levels, integers at most
LIMITS["int_digits"] digits, no key twice in an object (and no prototype twice in `gains`,
"5" and "05" alike), so no body reaches Python's recursion or int-string limits. Steering sets
travel as JSON content (the explorer's `{"gains": {id: g}}` or the set `prism suppress`
writes, `{"format": "prism_jax.suppression_set/1", "ids": [...]}`), never as a path; gains
and sets are read and checked by prism_jax/control/steering.py, the one place that does.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from prism_jax.control import steering

LIMITS = {
    "body_bytes": 64 * 1024,  # a request body, steering sets included
    "prompt_chars": 4000,
    "new_tokens": 256,
    "gain_max": 10.0,  # gains in [0, gain_max]: 0 removes, > 1 amplifies (control/steering)
    "temperature_max": 5.0,
    "seed_max": 2**31 - 1,
    "top_attributions": 20,
    "search_chars": 200,
    "json_depth": 16,  # nested arrays/objects: the API's own bodies nest 3 deep
    "int_digits": 20,  # every integer field is far below 10**20
}


class BadRequest(ValueError):
  """A refused request: `status` (4xx) and a one-line reason."""

  def __init__(self, message: str, status: int = 400):
    # one line, and short: a message may quote the request
    super().__init__(message.splitlines()[0][:300] if message else "bad request")
    self.status = status


def parse_body(raw: bytes) -> dict[str, Any]:
  if len(raw) > LIMITS["body_bytes"]:
    raise BadRequest(f"request body over {LIMITS['body_bytes']} bytes", 413)
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadRequest(f"request body is not UTF-8 (byte {e.start})") from None
  _check_depth(text)  # before json.loads, whose recursion would fail deep down
  try:
    obj = json.loads(text or "{}", parse_constant=_no_constant, parse_int=_int,
                     object_pairs_hook=_no_duplicates)
  except json.JSONDecodeError as e:
    raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
  except RecursionError:  # a backstop: _check_depth bounds the nesting first
    raise BadRequest(f"JSON nested deeper than {LIMITS['json_depth']} levels") from None
  if not isinstance(obj, dict):
    raise BadRequest(f"request body must be a JSON object, got {type(obj).__name__}")
  try:  # a "\ud800" escape decodes to a lone surrogate: no tokenizer or reply can encode it
    json.dumps(obj, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError as e:
    raise BadRequest(f"a string in the body holds a lone surrogate "
                     f"({ascii(e.object[e.start])}): not Unicode text") from None
  return obj


def _check_depth(text: str) -> None:
  """Refuses nesting over LIMITS["json_depth"]: brackets outside strings, one pass."""
  depth, in_string, escaped = 0, False, False
  for ch in text:
    if in_string:
      if escaped:
        escaped = False
      elif ch == "\\":
        escaped = True
      elif ch == '"':
        in_string = False
    elif ch == '"':
      in_string = True
    elif ch in "[{":
      depth += 1
      if depth > LIMITS["json_depth"]:
        raise BadRequest(f"JSON nested deeper than {LIMITS['json_depth']} levels")
    elif ch in "]}":
      depth -= 1


def _no_constant(name: str):
  raise BadRequest(f"malformed JSON: {name} is not a number JSON allows")


def _int(digits: str) -> int:
  # int() of over 4300 digits raises ValueError; a float() of a huge int, OverflowError
  if len(digits.lstrip("-")) > LIMITS["int_digits"]:
    raise BadRequest(f"an integer of {len(digits.lstrip('-'))} digits: at most "
                     f"{LIMITS['int_digits']} here")
  return int(digits)


def _no_duplicates(pairs: list) -> dict:
  seen = set()
  for key, _ in pairs:
    if key in seen:  # json.loads would keep the last silently
      raise BadRequest(f"duplicate key {key[:40]!r} in a JSON object")
    seen.add(key)
  return dict(pairs)


def only_fields(body: dict, allowed: set[str]) -> None:
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise BadRequest(f"unknown field {unknown[0][:40]!r}; allowed: "
                     f"{', '.join(sorted(allowed))}")


def integer(body: dict, name: str, default: int, lo: int, hi: int) -> int:
  v = body.get(name, default)
  if isinstance(v, bool) or not isinstance(v, int):
    raise BadRequest(f"{name} must be an integer, got {v!r}"[:200])
  if not lo <= v <= hi:
    raise BadRequest(f"{name} must be in [{lo}, {hi}], got {v}")
  return v


def number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
  v = body.get(name, default)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise BadRequest(f"{name} must be a finite number, got {v!r}"[:200])
  if not lo <= v <= hi:
    raise BadRequest(f"{name} must be in [{lo:g}, {hi:g}], got {v:g}")
  return float(v)


def boolean(body: dict, name: str, default: bool) -> bool:
  v = body.get(name, default)
  if not isinstance(v, bool):
    raise BadRequest(f"{name} must be true or false, got {v!r}"[:200])
  return v


def prompt_ids(body: dict, encode, vocab: int, max_tokens: int, field: str = "prompt"
               ) -> list[int]:
  """The prompt as token ids: `prompt` (text) or `ids` (a list of token ids)."""
  if ("prompt" in body) == ("ids" in body):
    raise BadRequest("give exactly one of 'prompt' (text) or 'ids' (token ids)")
  if "ids" in body:
    ids = body["ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
      raise BadRequest("ids must be a list of integers")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
      raise BadRequest(f"unknown token id {bad[0]}: the vocabulary has ids 0..{vocab - 1}")
  else:
    text = body[field]
    if not isinstance(text, str):
      raise BadRequest(f"{field} must be a string")
    if not text.strip():
      raise BadRequest(f"{field} is empty")
    if len(text) > LIMITS["prompt_chars"]:
      raise BadRequest(f"{field} has {len(text)} characters, the limit is "
                       f"{LIMITS['prompt_chars']}")
    ids = list(encode(text))
  if not ids:
    raise BadRequest(f"{field} encodes to no tokens")
  if len(ids) > max_tokens:
    raise BadRequest(f"the prompt has {len(ids)} tokens, the limit here is {max_tokens}")
  return ids


def gains(body: dict, num_prototypes: int, fingerprint: dict) -> dict[int, float]:
  """{prototype id: gain} from `gains` and/or `steering_set` (the set's JSON content), built
  and checked by control/steering.gain_map with the explorer's bound on a gain."""
  for name in ("gains", "steering_set"):
    if name in body and body[name] is None:  # null is not an absent field
      raise BadRequest(f"{name} must be a JSON object, got null")
  with refusals():
    return steering.gain_map(num_prototypes, body.get("gains", {}),
                             steering_set=body.get("steering_set"), fingerprint=fingerprint,
                             gain_max=LIMITS["gain_max"])


def proto_id(key, num_prototypes: int) -> int:
  """One prototype id of a request (a URL's or a field's), checked by control/steering."""
  with refusals():
    return steering.proto_id(key, num_prototypes)


@contextlib.contextmanager
def refusals():
  """control/steering's ValueErrors as BadRequests: 409 for another model's set, else 400."""
  try:
    yield
  except BadRequest:
    raise
  except steering.ForeignSetError as e:
    raise BadRequest(str(e), 409) from None
  except ValueError as e:
    raise BadRequest(str(e)) from None
