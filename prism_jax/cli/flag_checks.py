"""Flag checks shared by the scripts of experiments/ and benchmarks/ (issue 47, item 6;
here beside sampling_flags, issue 56: one module both import, neither from the other).

A script checks its flag combination at the top of main, before data, training, compiles or
big reads; each check raises a ValueError of one line naming the flag and the fix, which
prism_jax.cli.launcher prints as one `error:` line (exit status 2). Pure Python, no flags.
"""

from __future__ import annotations

import os
from typing import Iterable


def at_least(low: float, **values) -> None:
  """Each named flag's value is >= low (e.g. at_least(1, steps=FLAGS.steps))."""
  for name, value in values.items():
    if value is None or value < low:
      raise ValueError(f"--{name}={value}: must be >= {low}")


def in_range(name: str, value: float, low: float, high: float, *, low_open: bool = False,
             high_open: bool = False) -> None:
  """low <= value <= high, either end open on request."""
  ok_low = value > low if low_open else value >= low
  ok_high = value < high if high_open else value <= high
  if not (ok_low and ok_high):
    raise ValueError(f"--{name}={value}: must be in {'(' if low_open else '['}{low}, "
                     f"{high}{')' if high_open else ']'}")


def not_empty(**values) -> None:
  for name, value in values.items():
    if not value:
      raise ValueError(f"--{name} is empty: give at least one value")


def numbers(name: str, items: Iterable[str], kind=int, low: float | None = None) -> list:
  """A list flag's items as `kind` (int or float), each >= low when given."""
  out = []
  for item in items:
    try:
      value = kind(item)
    except ValueError:
      raise ValueError(f"--{name}: {item!r} is not {'an integer' if kind is int else 'a number'}"
                       ) from None
    if low is not None and value < low:
      raise ValueError(f"--{name}: {value} must be >= {low}")
    out.append(value)
  return out


def known(name: str, items: Iterable[str], choices: Iterable[str]) -> None:
  """Every item of a list flag is one of `choices`."""
  choices = list(choices)
  unknown = [item for item in items if item not in choices]
  if unknown:
    raise ValueError(f"--{name}: unknown {unknown}; choose from {sorted(choices)}")


def output_file(name: str, path: str | None) -> None:
  """A file written at the end of the run: its folder must exist now, not hours later.
  gs:// and other remote paths are not checked (no network round trip before the run)."""
  if not path or "://" in path:
    return
  if os.path.isdir(path):
    raise ValueError(f"--{name}={path}: is a directory; give a file path")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise ValueError(f"--{name}={path}: its folder {folder} does not exist; create it first")


def existing(name: str, path: str | None, what: str = "file or directory") -> None:
  """A path read by the run exists (remote paths are not checked)."""
  if path and "://" not in path and not os.path.exists(path):
    raise ValueError(f"--{name}={path}: no such {what}")
