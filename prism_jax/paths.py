"""Every path the project reads or writes: local, or an object store URI such as gs://.

The libraries' own file layers do the work: etils `epath` (gs:// through fsspec/gcsfs when
TensorFlow is absent), orbax and grain take epath paths, and `kvstore(path)` gives
tensorstore's own `file` or `gcs` kvstore spec for arrays. No HTTP is written here.

  p = paths.path("gs://bucket/run")    # an epath.Path; a local path is made absolute
  paths.write_text_atomic(p / "x.json", text)
  ts.open({"driver": "zarr3", "kvstore": paths.kvstore(p / "g")})

Emulators and tests: gcsfs and the google clients read STORAGE_EMULATOR_HOST, tensorstore
reads TENSORSTORE_GCS_HTTP_URL (and GOOGLE_AUTH_TOKEN_FOR_TESTING for a dummy token).
A gs:// path that cannot be reached (no credentials, no emulator) raises PathAccessError
naming the path (`check_access`).
"""

from __future__ import annotations

import glob as glob_lib
import io
import os
import re
import shutil
import time
from typing import Any

import numpy as np
from etils import epath

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class PathAccessError(PermissionError):
  """An object-store path that cannot be reached (credentials, emulator, bucket)."""


def scheme(p) -> str | None:
  """'gs', 's3', ... for a URI, None for a local path (file:// counts as local)."""
  m = _URI.match(os.fspath(p))
  return None if m is None or m.group(1) == "file" else m.group(1)


def is_remote(p) -> bool:
  return scheme(p) is not None


def resolve(p) -> str:
  """The string form stored in configs and metadata: a URI as given, a local path absolute."""
  s = os.fspath(p)
  if s.startswith("file://"):
    s = s[len("file://"):]
  return s.rstrip("/") if is_remote(s) else os.path.abspath(s)


GCS_EXTRA = "gs:// paths need the gcs extra: pip install 'prism_jax[gcs]'"


def _check_backend(s: str) -> None:
  """A gs:// path without gcsfs (the `gcs` extra) is one clear error, not an ImportError
  from deep inside etils."""
  if scheme(s) == "gs":
    try:
      import gcsfs  # pylint: disable=import-outside-toplevel,unused-import  # noqa: F401  (deferred: optional, the gcs extra)
    except ImportError:
      raise PathAccessError(f"cannot open {s}: {GCS_EXTRA}") from None


def path(p) -> epath.Path:
  """An epath.Path for p (resolved as above)."""
  s = resolve(p)
  _check_backend(s)
  return epath.Path(s)


def join(p, *parts: str) -> str:
  """String join that keeps a URI's '//' (os.path.join does too; this also resolves)."""
  return os.fspath(path(p).joinpath(*parts))


def _describe(p: str, err: Exception) -> str:
  hint = ("set up Google Cloud credentials (gcloud auth application-default login), or "
          "point STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL at an emulator")
  first = str(err).splitlines()[0] if str(err) else type(err).__name__
  return f"cannot reach {p}: {first[:200]}; {hint}"


_CHECKED: set[str] = set()


def check_access(p) -> None:
  """Raises PathAccessError (one line naming p) if p's bucket cannot be listed; local
  paths and buckets already checked in this process are not probed."""
  s = resolve(p)
  if not is_remote(s):
    return
  root = s.split("://", 1)[0] + "://" + s.split("://", 1)[1].split("/", 1)[0]
  if root in _CHECKED:
    return
  if scheme(s) == "gs" and not os.environ.get("STORAGE_EMULATOR_HOST"):
    _check_gcs_credentials(s)
  try:
    fs = _fsspec(s)
    fs.ls(root.split("://", 1)[1], detail=False)
  except Exception as e:  # pylint: disable=broad-except  (auth errors have many types)
    raise PathAccessError(_describe(s, e)) from e
  _CHECKED.add(root)


def _check_gcs_credentials(s: str) -> None:
  """Fails fast (before any request and its retries) when no credentials are found."""
  try:
    import google.auth  # pylint: disable=import-outside-toplevel  (deferred: optional, the gcs extra)
    import google.auth.exceptions  # pylint: disable=import-outside-toplevel  (deferred: optional, the gcs extra)
  except ImportError as e:
    raise PathAccessError(f"cannot open {s}: {GCS_EXTRA}") from e
  try:
    google.auth.default()
  except google.auth.exceptions.DefaultCredentialsError as e:
    raise PathAccessError(_describe(s, RuntimeError("no Google Cloud credentials found"))
                          ) from e


def _fsspec(s: str):
  import fsspec  # pylint: disable=import-outside-toplevel  (deferred: fsspec, for gs:// only)
  try:
    return fsspec.filesystem(scheme(s))
  except ImportError as e:
    raise PathAccessError(f"cannot open {s}: the {scheme(s)}:// filesystem is not "
                          f"installed ({e})") from e


def kvstore(p) -> dict[str, Any]:
  """tensorstore's kvstore spec for directory p: `file`, or `gcs` for gs://."""
  s = resolve(p)
  sch = scheme(s)
  if sch is None:
    return {"driver": "file", "path": s}
  if sch != "gs":
    raise ValueError(f"{s}: tensorstore arrays support local and gs:// paths, not {sch}://")
  bucket, _, key = s[len("gs://"):].partition("/")
  return {"driver": "gcs", "bucket": bucket, "path": key.rstrip("/") + "/"}


def write_bytes_atomic(p, data: bytes) -> None:
  """A kill leaves the old or the new content, never half: a local temp file + rename;
  an object store's single upload is atomic already."""
  s = resolve(p)
  if is_remote(s):
    check_access(s)
    epath.Path(s).write_bytes(data)
    return
  tmp = f"{s}.tmp-{os.getpid()}-{time.time_ns()}"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, s)
  except BaseException as e:
    # A full disk fails at the write or the close, after open made the temp file: remove
    # it (it would pile up, one per retry, on the very disk that is full).
    try:
      os.remove(tmp)
    except OSError:
      pass
    if isinstance(e, OSError) and e.errno is not None:
      # a failed write or close names no file: name the one being written (OSError() with
      # an errno makes the matching subclass, PermissionError for EACCES...)
      raise OSError(e.errno, e.strerror or os.strerror(e.errno), s) from e
    raise


def write_text_atomic(p, text: str) -> None:
  write_bytes_atomic(p, text.encode("utf-8"))


def load_npy(p, mmap: bool = True) -> np.ndarray:
  """A .npy array: memory-mapped when local (and mmap), read whole from an object store."""
  s = resolve(p)
  if not is_remote(s):
    return np.load(s, mmap_mode="r" if mmap else None)
  return np.load(io.BytesIO(epath.Path(s).read_bytes()), allow_pickle=False)


def save_npy(p, arr: np.ndarray) -> None:
  buf = io.BytesIO()
  np.save(buf, np.asarray(arr), allow_pickle=False)
  write_bytes_atomic(p, buf.getvalue())


def tree_bytes(p) -> int:
  """Total size of the files under directory p."""
  s = resolve(p)
  if is_remote(s):  # (epath's walk drops the scheme from the roots it yields)
    return int(_fsspec(s).du(s))
  total = 0
  for root, _, files in path(s).walk():
    total += sum((root / f).stat().length for f in files)
  return total


def open_file(p, mode: str = "rb"):
  """A file object for reading or writing p (the builtin open when local)."""
  s = os.fspath(p)
  if not is_remote(s):
    return open(s, mode)  # pylint: disable=unspecified-encoding
  check_access(s)
  return epath.Path(s).open(mode)


def glob(pattern: str) -> list[str]:
  """Files matching pattern, sorted ('**' recursive); gs:// patterns through fsspec."""
  if not is_remote(pattern):
    return sorted(p for p in glob_lib.glob(pattern, recursive=True) if os.path.isfile(p))
  check_access(pattern)
  fs, sch = _fsspec(pattern), scheme(pattern)
  return sorted(f"{sch}://{m}" for m in fs.glob(pattern) if fs.isfile(m))


def move_tree(src, dst) -> None:
  """Moves a directory: a rename locally, copy-then-delete (fsspec) on an object store."""
  src, dst = resolve(src), resolve(dst)
  if not is_remote(src) and not is_remote(dst):
    shutil.move(src, dst)
    return
  fs = _fsspec(src)
  fs.copy(src.rstrip("/") + "/", dst.rstrip("/") + "/", recursive=True)
  fs.rm(src, recursive=True)
