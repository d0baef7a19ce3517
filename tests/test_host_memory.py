"""cli/host_memory: freed host memory stays in the process (no page faults on reuse),
applied only by the command-line launcher (experiments/cli.py), never by the library.

Each case runs in a fresh interpreter: the allocator setting is process-wide and one-way.
The probe mallocs, writes and frees a 64 MiB buffer twice (plain malloc: numpy would ask
for huge pages) and counts the minor page faults of the second round (getrusage): with the
setting the second buffer reuses the heap's pages (~0 faults); glibc's defaults mmap it
afresh (one fault per 4 KiB page). The thread probe does the same on a new thread (its own
malloc arena, as XLA's workers) with 40 MiB buffers beside a kept 40 MiB one, so each lands
in a second arena heap, which glibc unmaps when it empties unless the top pad is set:
raising the two thresholds alone does not stop that.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = (64 << 20) // 4096

PROBE = r"""
import ctypes, json, resource, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
applied = None
if sys.argv[1] == "thresholds":  # the two thresholds alone (round 3's setting)
  applied = bool(libc.mallopt(-3, 2**31 - 1)) and bool(libc.mallopt(-1, 2**31 - 1))
elif sys.argv[1] == "retain":
  from prism_jax.cli import host_memory
  applied = host_memory.retain_freed_memory()
elif sys.argv[1] == "train_step":  # the library: building (and running) a step
  import jax, optax
  from prism_jax.cli import host_memory
  from prism_jax.train import engine
  loss = lambda p, b: (jax.numpy.sum(p["w"] * b), {})
  step = engine.make_step(loss, optax.sgd(0.1))
  applied = host_memory._applied
elif sys.argv[1] == "launcher":  # the command-line launcher's opt-in
  from prism_jax.cli import launcher as cli
  applied = cli.retain_freed_host_memory()
def faults_of_one_round(size):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  buf = libc.malloc(size)
  ctypes.memset(buf, 1, size)  # every page written
  libc.free(buf)
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def rounds(size, out):
  faults_of_one_round(size)
  out["faults"] = faults_of_one_round(size)
out = {"applied": applied}
if sys.argv[2] == "thread":
  def worker():
    kept = libc.malloc(40 << 20)
    ctypes.memset(kept, 1, 40 << 20)  # fills the thread arena's first heap
    rounds(40 << 20, out)
  thread = threading.Thread(target=worker)
  thread.start()
  thread.join()
else:
  rounds(64 << 20, out)
print(json.dumps(out))
"""


def run_probe(mode: str, where: str = "main", **env) -> dict:
  out = subprocess.run([sys.executable, "-c", PROBE, mode, where], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@glibc_only
def test_freed_memory_is_reused_without_page_faults():
  default = run_probe("none")
  retained = run_probe("retain")
  assert default["faults"] > PAGES // 2, default  # glibc's default: a fresh mmap per round
  assert retained["applied"] is True
  assert retained["faults"] < PAGES // 20, retained


@glibc_only
def test_a_worker_threads_freed_heap_is_kept():
  pages = (40 << 20) // 4096
  for mode in ("none", "thresholds"):  # glibc unmaps the emptied heap either way
    res = run_probe(mode, "thread")
    assert res["faults"] > pages // 2, (mode, res)
  res = run_probe("retain", "thread")
  assert res["applied"] is True
  assert res["faults"] < pages // 20, res


@glibc_only
def test_building_a_train_step_changes_no_malloc_setting():
  """The library changes no process state: after make_step the heap behaves as glibc's
  default (a fresh mmap per round), and the setting was never applied."""
  res = run_probe("train_step")
  assert res["applied"] is None
  assert res["faults"] > PAGES // 2, res


@glibc_only
def test_the_launcher_opts_in():
  res = run_probe("launcher")
  assert res["applied"] is True
  assert res["faults"] < PAGES // 20, res


@glibc_only
def test_the_environment_variable_opts_out():
  res = run_probe("retain", PRISM_JAX_RETAIN_FREED_MEMORY="0")
  assert res["applied"] is False
  assert res["faults"] > PAGES // 2, res
  res = run_probe("launcher", PRISM_JAX_RETAIN_FREED_MEMORY="0")
  assert res["applied"] is False
  assert res["faults"] > PAGES // 2, res
