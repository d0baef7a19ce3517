"""Dotted-key overrides of a Config (`--set model.k=8`), config <-> dict, and config diffs.

Values given as strings are parsed by the field's declared type: int, float, bool, str,
`X | None`, `tuple[str, ...]` (comma separated) and Literal choices. Unknown keys and
ill-typed values raise ValueError naming the key and listing what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Iterable, Mapping

from prism_jax.config import Config

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@functools.cache
def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)  # config.py uses postponed (string) annotations


def _fields(cfg_cls=Config, prefix: str = "") -> dict[str, Any]:
  """Dotted leaf key -> declared type, for every leaf field under `cfg_cls`."""
  out = {}
  for f in dataclasses.fields(cfg_cls):
    tp = _hints(cfg_cls)[f.name]
    if dataclasses.is_dataclass(tp):
      out.update(_fields(tp, f"{prefix}{f.name}."))
    else:
      out[f"{prefix}{f.name}"] = tp
  return out


def valid_keys() -> list[str]:
  return sorted(_fields())


def _describe(tp) -> str:
  if typing.get_origin(tp) is typing.Literal:
    return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _parse(key: str, text: str, tp) -> Any:
  """Parse `text` as a value of type `tp`; ValueError on mismatch."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is typing.Literal:
    for choice in args:
      if text == str(choice):
        return choice
    raise ValueError(f"--set {key}={text!r}: expected {_describe(tp)}")
  if origin in (typing.Union, types.UnionType):
    if type(None) in args and text.lower() in ("none", "null", ""):
      return None
    errors = []
    for arm in args:
      if arm is type(None):
        continue
      try:
        return _parse(key, text, arm)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(f"--set {key}={text!r}: expected {_describe(tp)}")
  if origin is tuple:
    items = [s.strip() for s in text.split(",") if s.strip()]
    elem = args[0] if args else str
    return tuple(_parse(key, s, elem) for s in items)
  if tp is bool:
    low = text.strip().lower()
    if low in _TRUE:
      return True
    if low in _FALSE:
      return False
    raise ValueError(f"--set {key}={text!r}: expected a bool (true/false/1/0)")
  if tp in (int, float):
    try:
      return tp(text)
    except ValueError:
      raise ValueError(f"--set {key}={text!r}: expected {tp.__name__}") from None
  if tp is str:
    return text
  raise ValueError(f"--set {key}: unsupported field type {tp}")


def _check_typed(key: str, value: Any, tp) -> Any:
  """Validate an already-typed value (notebook use: {'model.k': 8})."""
  if isinstance(value, str):
    return _parse(key, value, tp)
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  ok = False
  if origin is typing.Literal:
    ok = value in args
  elif origin in (typing.Union, types.UnionType):
    ok = any(a is type(None) and value is None or
             a is not type(None) and _type_ok(value, a) for a in args)
  else:
    ok = _type_ok(value, tp)
  if not ok:
    raise ValueError(f"--set {key}={value!r}: expected {_describe(tp)}")
  if origin is tuple or tp is tuple:
    value = tuple(value)
  if tp is float:
    value = float(value)
  return value


def _type_ok(value, tp) -> bool:
  origin = typing.get_origin(tp)
  if origin is typing.Literal:
    return value in typing.get_args(tp)
  if origin is tuple:
    return isinstance(value, (tuple, list))
  if tp is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, tp)


def parse_override(item: str) -> tuple[str, str]:
  """'model.k=8' -> ('model.k', '8')."""
  if "=" not in item:
    raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set model.k=8")
  key, value = item.split("=", 1)
  return key.strip(), value.strip()


def _unknown(key: str) -> ValueError:
  keys = valid_keys()
  close = difflib.get_close_matches(key, keys, n=3)
  hint = f" (did you mean {', '.join(close)}?)" if close else ""
  return ValueError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(keys)}")


def apply_overrides(cfg: Config, overrides: Iterable[str] | Mapping[str, Any]) -> Config:
  """A new Config with dotted-key overrides applied (then validated by the dataclasses)."""
  fields = _fields()
  items = (overrides.items() if isinstance(overrides, Mapping)
           else (parse_override(s) for s in overrides))
  updates: dict[str, dict[str, Any]] = {}
  for key, value in items:
    if key not in fields:
      raise _unknown(key)
    section, name = key.split(".", 1)
    updates.setdefault(section, {})[name] = _check_typed(key, value, fields[key])
  return dataclasses.replace(cfg, **{
      section: dataclasses.replace(getattr(cfg, section), **vals)
      for section, vals in updates.items()})


def flatten(cfg_or_dict: Config | Mapping[str, Any]) -> dict[str, Any]:
  """Dotted leaf key -> value (tuples as lists: the JSON view)."""
  d = dataclasses.asdict(cfg_or_dict) if dataclasses.is_dataclass(cfg_or_dict) else cfg_or_dict
  out = {}
  for section, vals in d.items():
    for name, value in vals.items():
      out[f"{section}.{name}"] = list(value) if isinstance(value, tuple) else value
  return out


def config_from_dict(d: Mapping[str, Any]) -> Config:
  """Inverse of `prism_jax.config.to_dict` (e.g. a checkpoint's config.json).

  Keys unknown to this version are an error; keys this version added are defaulted.
  """
  fields = _fields()
  flat = flatten(d)
  unknown = sorted(set(flat) - set(fields))
  if unknown:
    raise ValueError(f"config has keys unknown to this version of prism_jax: {unknown}")
  return apply_overrides(Config(), {k: (tuple(v) if isinstance(v, list) else v)
                                    for k, v in flat.items()})


def config_diff(a: Config | Mapping[str, Any], b: Config | Mapping[str, Any],
                ignore: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
  """[(key, a_value, b_value)] for every dotted key whose values differ.

  A mapping (a stored config.json) is read with `config_from_dict` first, so a field added
  since it was written compares as its default, not as missing."""
  a, b = (config_from_dict(x) if isinstance(x, Mapping) else x for x in (a, b))
  fa, fb, skip = flatten(a), flatten(b), set(ignore)
  return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
          if k not in skip and fa.get(k) != fb.get(k)]
