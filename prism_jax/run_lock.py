"""One writer per run: an exclusive lock on a run directory while a command writes into it.

  with run_lock.hold("runs/x", "prism train"):
    ...  # nothing else writes into runs/x meanwhile

`prism train` (`train()`), the attribution cache build, cards, the report and suppression take
it. A second writer fails at once with `RunLockedError` (a ValueError: the launcher's one
`error:` line), naming the holder's host, pid, command and start time.

The lock is `flock` on `<run>/.prism_lock`, which holds the holder's identity as JSON. The
kernel releases an flock when its process dies, however it dies, so a lock can never be left
held; what a killed holder leaves is its identity in the file, which the next writer reports
in one line as a lock taken over from a process that is gone. The file itself is never
deleted: unlinking it would let a process that opened the old file and one that creates a new
one both hold "the" lock.

Reentrant within a process (a train() that builds its cache holds it once). In a
multi-process job only process 0 takes it (every process of one job writes into the run);
a second job is refused by its own process 0, whose failure ends the job.

Object storage (gs://) has no flock: no lock is taken there (logged once per run). A pod
job's scheduler is expected to run one job per run directory; two jobs on one gs:// run are
not detected.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

from absl import logging

from prism_jax import paths

LOCK_FILE = ".prism_lock"

_held: dict[str, list] = {}  # real path of the lock file -> [fd, depth]
_guard = threading.Lock()


class RunLockedError(ValueError):
  """Another process is writing into this run directory."""


def _is_primary() -> bool:
  # Reads jax's state only when jax is already imported: this module stays import-light.
  jax = sys.modules.get("jax")
  if jax is None or not jax.distributed.is_initialized():
    return True
  return jax.process_index() == 0


def _identity(command: str) -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(), "command": command[:200],
          "since": datetime.datetime.now().isoformat(timespec="seconds")}


def _read(fd: int) -> dict | None:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = os.read(fd, 4096)
  if not raw.strip():
    return None
  try:
    out = json.loads(raw)
    return out if isinstance(out, dict) else None
  except ValueError:
    return {"command": "unknown (the lock file is not JSON)"}


def _holder_identity(fd: int, wait_s: float = 2.0) -> dict | None:
  """The holder's identity: it writes it just after taking the flock, so a writer refused
  in between reads an empty file; it waits for it a moment (2 s at most)."""
  deadline = time.monotonic() + wait_s
  while True:
    holder = _read(fd)
    if holder or time.monotonic() > deadline:
      return holder
    time.sleep(0.02)


def describe(holder: dict | None) -> str:
  if not holder:
    return "another process (no identity recorded yet)"
  return (f"{holder.get('command', '?')!r} (pid {holder.get('pid', '?')} on "
          f"{holder.get('host', '?')}, since {holder.get('since', '?')})")


def _alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except (OSError, ValueError, TypeError) as e:
    return isinstance(e, OSError) and e.errno == errno.EPERM
  return True


def _acquire(lock_path: str, workdir: str, command: str) -> int | None:
  """The locked fd; None where the run cannot be written at all (a read-only run: the
  command then fails at its first write, or only reads)."""
  try:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
      logging.info("%s is not writable here: no run lock taken (%s)", workdir, e.strerror)
      return None
    raise
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _holder_identity(fd)
      raise RunLockedError(
          f"{workdir} is being written by {describe(holder)}: one writer per run; wait for "
          "it to finish, or use another --workdir") from None
    left = _read(fd)
    if left:  # its writer died holding it (the kernel released the flock, not the writer)
      here = left.get("host") == socket.gethostname()
      gone = "no longer running" if here and not _alive(left.get("pid")) else "not holding it"
      logging.warning("%s: taking over the lock left by %s (%s)", workdir, describe(left),
                      gone)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(_identity(command)).encode())
    os.fsync(fd)
    return fd
  except BaseException:
    os.close(fd)  # closing releases the flock: a failed acquire holds nothing
    raise


def _release(fd: int | None) -> None:
  if fd is None:
    return
  try:
    os.ftruncate(fd, 0)  # empty: released cleanly (a non-empty file means its writer died)
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def hold(workdir: str, command: str | None = None) -> Iterator[None]:
  """Holds the run's lock for the block (an existing local `workdir`; nothing to lock
  otherwise); RunLockedError at once when another process holds it. `command` names this writer in that message
  (default: this process's command line)."""
  if not workdir:
    yield
    return
  workdir = paths.resolve(workdir)
  if paths.is_remote(workdir) or not _is_primary() or not os.path.isdir(workdir):
    if paths.is_remote(workdir):
      logging.info("%s is on object storage: no run lock is taken there", workdir)
    yield  # not a directory yet: the command's own check names the missing run
    return
  lock_path = os.path.realpath(os.path.join(workdir, LOCK_FILE))
  command = command or " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])
  with _guard:
    entry = _held.get(lock_path)
    if entry is not None:
      entry[1] += 1
    else:
      fd = _acquire(lock_path, workdir, command)
      _held[lock_path] = [fd, 1]
  try:
    yield
  finally:
    with _guard:
      entry = _held[lock_path]
      entry[1] -= 1
      if entry[1] == 0:
        del _held[lock_path]
        _release(entry[0])
