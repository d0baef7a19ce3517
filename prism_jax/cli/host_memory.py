"""Keep freed host memory in the process, so XLA:CPU's per-step buffers are not page-faulted
in again every step.

XLA:CPU allocates each execution's temporaries (every activation the backward pass keeps,
every gradient) with malloc and frees them when the step ends. glibc serves allocations
above its mmap threshold (dynamic, at most 32 MiB) with fresh mmap()s and gives freed heap
tops back to the kernel above its trim threshold, so every step touches new pages: one
minor page fault per 4 KiB, which at the byte-level config (d 128, 12 x 64 tokens) was about
a third of the dense train step's time on CPU (docs/history/RESULTS-to-2026-12-06.md,
"Training throughput", round 3). Raising both thresholds keeps the memory in the heap for the next step.

XLA's worker threads allocate from their own arenas, whose extra heaps (64 MiB address
ranges) glibc unmaps as soon as one is empty, whatever the thresholds; only a top pad
larger than a heap stops that (glibc's heap_trim keeps a heap while the room left below it
is under the pad). Without it two programs run alternately (a dense and a PRISM step in
one process) faulted 5,000-9,000 pages per step (round 4). The pad also makes each brk
growth of the main heap reserve that much address space (not memory: pages untouched
stay unallocated).

The library never calls `retain_freed_memory()`: it changes the whole process's allocator
(the heap no longer shrinks after a peak), so only a command-line launcher opts in
(prism_jax/cli/launcher.py `retain_freed_host_memory`, logged when applied); a notebook may call
it too. A no-op off glibc. The launcher's opt-out: PRISM_JAX_RETAIN_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV_VAR = "PRISM_JAX_RETAIN_FREED_MEMORY"
# mallopt(3) parameters (glibc's malloc.h) and the largest value they take (an int).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
THRESHOLD = 2**31 - 1
TOP_PAD = 256 << 20  # > glibc's 64 MiB heap size plus a heap's worth of free room below it

_applied: bool | None = None


def _libc():
  name = ctypes.util.find_library("c")
  if name is None:
    return None
  try:
    libc = ctypes.CDLL(name)
  except OSError:
    return None
  return libc if hasattr(libc, "mallopt") else None  # mallopt: glibc (and musl has none)


def retain_freed_memory() -> bool:
  """Set glibc's trim and mmap thresholds to 2 GiB and its top pad to 256 MiB, once per
  process. True when they are set (now or by an earlier call); False off glibc or when
  PRISM_JAX_RETAIN_FREED_MEMORY=0.
  """
  global _applied
  if _applied is not None:
    return _applied
  if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
    _applied = False
    return False
  libc = _libc()
  if libc is None:
    _applied = False
    return False
  libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  _applied = all([libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD),
                  libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD), libc.mallopt(M_TOP_PAD, TOP_PAD)])
  return _applied
