"""Where runs read and write: output directories claimed before use, config paths absolute.

`claim_output_dir(path, kind)` is called before anything is written to an output directory
(attribution cache, cards, reports). It accepts a missing or empty directory, or one that
already holds a marker file of the same kind (a resume); `rebuild=True` empties only a
directory of that kind. A training run directory, a packed-data directory, a directory of
another kind and any other non-empty directory are refused with a message naming them, so
a mistyped --cache_dir can never overwrite a run's data or checkpoints.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from prism_jax import paths

MARKER = ".prism_output"  # JSON {"kind": ...}, written first into a claimed directory


class OutputDirError(ValueError):
  """An output directory that is not ours to write into (or to delete)."""


def read_kind(path: str) -> str | None:
  """The kind recorded in path's marker, or None if it has none."""
  marker = paths.path(path) / MARKER
  if not marker.is_file():
    return None
  try:
    return str(json.loads(marker.read_text())["kind"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise OutputDirError(f"{marker} is unreadable ({e}); inspect {path} by hand") from e


def _foreign(path: str) -> str | None:
  """Why `path` is recognisably someone else's directory (run, packed data), or None."""
  names = {p.name for p in paths.path(path).iterdir()}
  if "checkpoints" in names or "config.json" in names:
    return "a training run directory (it holds checkpoints/ or config.json)"
  meta = paths.path(path) / "metadata.json"
  if "metadata.json" in names:
    try:
      keys = set(json.loads(meta.read_text()))
    except (OSError, ValueError, TypeError):
      keys = set()
    if "source_hash" in keys:
      return "a packed-data directory (data.packed_dir)"
  return None


def _write_marker(path: str, kind: str) -> None:
  paths.write_text_atomic(paths.join(path, MARKER), json.dumps({"kind": kind}))


def _empty(path: str) -> None:
  for full in paths.path(path).iterdir():
    if full.is_dir() and not os.path.islink(full):
      full.rmtree()
    else:
      full.unlink()


def _is_empty_or_missing(p) -> bool:
  """Missing or empty (an object store has no empty directories: missing is empty)."""
  return not p.exists() or (p.is_dir() and next(iter(p.iterdir()), None) is None)


def claim_output_dir(path: str, kind: str, *, rebuild: bool = False,
                     legacy: Callable[[str], bool] | None = None) -> str:
  """Makes `path` a directory of `kind` (absolute path returned) or raises OutputDirError.

  `legacy(path)` recognises a directory of this kind written before markers existed (it
  is adopted: the marker is added). `rebuild` empties the directory, only if it is ours.
  """
  path = paths.resolve(path)
  paths.check_access(path)
  p = paths.path(path)
  if p.exists() and not p.is_dir():
    raise OutputDirError(f"{kind} output {path} exists and is not a directory")
  if _is_empty_or_missing(p):
    p.mkdir(parents=True, exist_ok=True)
    _write_marker(path, kind)
    return path
  have = read_kind(path)
  if have is None:
    why = _foreign(path)
    if why is not None:
      raise OutputDirError(f"refusing to write the {kind} into {path}: it is {why}; "
                           "choose another directory" + (" (--rebuild never deletes it)"
                                                         if rebuild else ""))
    if legacy is None or not legacy(path):
      raise OutputDirError(f"refusing to write the {kind} into {path}: it is not empty and "
                           f"has no {MARKER} marker of a {kind}; choose an empty or new "
                           "directory")
  elif have != kind:
    raise OutputDirError(f"refusing to write the {kind} into {path}: it holds a {have} "
                         f"(see {paths.join(path, MARKER)}); choose another directory")
  if rebuild:
    _empty(path)
  _write_marker(path, kind)
  return path


def find_packed_dir(workdir: str, packed_dir: str, must_exist: bool = True) -> str:
  """The absolute packed-data directory of a run. A relative packed_dir (runs from before
  paths were stored absolute) is tried against the cwd, then the workdir; with must_exist
  an error names both, otherwise the cwd one is returned (to be packed)."""
  if not packed_dir:
    return paths.join(workdir, "data")
  if os.path.isabs(packed_dir) or paths.is_remote(packed_dir):
    return packed_dir
  tries = [os.path.abspath(packed_dir), paths.join(workdir, packed_dir)]
  for t in tries:
    if paths.path(t).is_dir():
      return t
  if not must_exist:
    return tries[0]
  raise FileNotFoundError(f"the run's relative data.packed_dir {packed_dir!r} is neither "
                          f"{tries[0]} nor {tries[1]}; pass the right directory")
