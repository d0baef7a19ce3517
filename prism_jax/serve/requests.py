"""The explorer's request checks: every bound in one place, each refusal one line.

A request body is a JSON object with known fields only (an unknown field, a path among them,
is refused by name); strings are UTF-8; numbers are finite and inside LIMITS. The parse itself
is bounded: nesting at most LIMITS["json_depth"] levels, integers at most
LIMITS["int_digits"] digits, no key twice in an object (and no prototype twice in `gains`,
"5" and "05" alike), so no body reaches Python's recursion or int-string limits. Steering sets
travel as JSON content (the explorer's `{"gains": {id: g}}` or the set `prism suppress`
writes, `{"format": "prism_jax.suppression_set/1", "ids": [...]}`), never as a path.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from prism_jax.control.suppression import FORMAT as SUPPRESSION_FORMAT

LIMITS = {
    "body_bytes": 64 * 1024,  # a request body, steering sets included
    "prompt_chars": 4000,
    "new_tokens": 256,
    "gain_max": 10.0,  # gains in [0, gain_max]: 0 removes, > 1 amplifies
    "temperature_max": 5.0,
    "seed_max": 2**31 - 1,
    "top_attributions": 20,
    "search_chars": 200,
    "json_depth": 16,  # nested arrays/objects: the API's own bodies nest 3 deep
    "int_digits": 20,  # every integer field is far below 10**20
}
_PROTO_KEY = re.compile(r"\s*[+-]?[0-9]{1,10}\s*")  # ASCII digits: not "5_0" nor "٥"


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
  """{prototype id: gain} from `gains` and/or `steering_set` (the set's JSON content)."""
  out: dict[int, float] = {}
  raw = body.get("gains", {})
  if not isinstance(raw, dict):
    raise BadRequest("gains must be an object {prototype id: gain}")
  if len(raw) > num_prototypes:
    raise BadRequest(f"gains has {len(raw)} entries, the bank has {num_prototypes} prototypes")
  named: dict[int, str] = {}
  for key, g in raw.items():
    i = _proto_id(key, num_prototypes)
    if i in named:  # "5" and "05" are distinct keys naming one prototype: which gain holds?
      raise BadRequest(f"gains names prototype {i} twice ({named[i][:20]!r} and "
                       f"{str(key)[:20]!r})")
    named[i] = str(key)
    out[i] = number({"gain": g}, "gain", 1.0, 0.0, LIMITS["gain_max"])
  if "steering_set" in body:
    for i, g in steering_set(body["steering_set"], num_prototypes, fingerprint).items():
      out[i] = out.get(i, 1.0) * g
  return out


def _proto_id(key, num_prototypes: int) -> int:
  # int() alone would take 1.7, True, "5_0" and "٥": only an int or ASCII digits name one
  if isinstance(key, str) and _PROTO_KEY.fullmatch(key):
    i = int(key)
  elif isinstance(key, int) and not isinstance(key, bool):
    i = key
  else:
    raise BadRequest(f"prototype id must be an integer, got {str(key)[:40]!r}")
  if not 0 <= i < num_prototypes:
    raise BadRequest(f"unknown prototype id {i}: the bank has ids 0..{num_prototypes - 1}")
  return i


def steering_set(obj, num_prototypes: int, fingerprint: dict) -> dict[int, float]:
  """An uploaded set: the explorer's {"gains": {...}} or `prism suppress`'s saved set."""
  if isinstance(obj, str):
    raise BadRequest("steering_set must be the set's JSON content, not a path or name")
  if not isinstance(obj, dict):
    raise BadRequest("steering_set must be a JSON object")
  if obj.get("format") == SUPPRESSION_FORMAT:
    have = obj.get("fingerprint", {})
    if not isinstance(have, dict):
      raise BadRequest("the suppression set's fingerprint must be a JSON object")
    diff = [k for k in fingerprint if have.get(k) != fingerprint[k]]
    if diff:
      raise BadRequest(f"this suppression set was saved for another model ({', '.join(diff)} "
                       "differ)", 409)
    ids = obj.get("ids")
    if not isinstance(ids, list):
      raise BadRequest("suppression set has no list of ids")
    return {_proto_id(i, num_prototypes): 0.0 for i in ids}
  only_fields(obj, {"gains", "format", "note"})
  if obj.get("format", "prism_jax.steering/1") != "prism_jax.steering/1":
    raise BadRequest(f"unknown steering set format {str(obj.get('format'))[:60]!r}")
  return gains({"gains": obj.get("gains", {})}, num_prototypes, fingerprint)
