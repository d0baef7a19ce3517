"""Worker processes end when the process that started them dies, however it dies.

A pool's workers (the packer's ProcessPoolExecutor) wait on a pipe whose write end they
hold themselves, so a parent killed with SIGKILL (a preempted VM, the OOM killer, a
scheduler) leaves them running, re-parented to init, with their memory and CPU, while the
resumed job packs beside them (issue 49). `die_with_parent(parent_pid)`, run first in every
worker, closes that hole two ways:

  - Linux: prctl(PR_SET_PDEATHSIG, SIGKILL): the kernel kills the worker the moment its
    parent goes (also while the worker is busy in C code holding the GIL). The signal
    follows the parent *thread* that started the worker, which for a pool is the thread
    that called pack() and lives as long as the pool.
  - everywhere: a daemon thread that polls the parent's pid every POLL_S seconds and ends
    the worker when it changes (the kernel's signal, where it exists, comes first).

A parent that died before the guard was set is caught by the first check. Work a worker
had finished and written is kept (packing's done.json per piece); a resumed job redoes the
rest. Process-wide state of the *worker* only: the library's own process is untouched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0
EXIT_CODE = 70  # what a worker orphaned before its kernel signal exits with


def _kernel_signal() -> bool:
  """Ask Linux to SIGKILL this process when its parent dies; False where it cannot."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def _watch(parent_pid: int, poll_s: float) -> None:
  while True:
    if os.getppid() != parent_pid:
      os._exit(EXIT_CODE)  # no cleanup: the parent that would collect our result is gone
    time.sleep(poll_s)


def die_with_parent(parent_pid: int, poll_s: float = POLL_S) -> str:
  """Make this (worker) process end when `parent_pid` dies: "pdeathsig" when the kernel
  will signal it, "poll" when only the watcher thread guards it."""
  how = "pdeathsig" if _kernel_signal() else "poll"
  if os.getppid() != parent_pid:  # the parent died before the guard was in place
    os._exit(EXIT_CODE)
  threading.Thread(target=_watch, args=(parent_pid, poll_s), daemon=True,
                   name="die_with_parent").start()
  return how
