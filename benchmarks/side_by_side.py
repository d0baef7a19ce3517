"""Fresh clones of this repository at two commits, for the side-by-side timings
(benchmarks/demo_time.py: `make demo`; benchmarks/suite_time.py: `make test`), and what a
timed `make test` printed. Flag-free (the tests import it)."""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def uv_cache() -> dict:
  """uv's package cache (both clones install from it): its path, size and warm/cold."""
  path = os.environ.get("UV_CACHE_DIR") or os.path.expanduser("~/.cache/uv")
  size = 0
  for root, _, files in os.walk(path):
    size += sum(os.path.getsize(os.path.join(root, f)) for f in files
                if os.path.isfile(os.path.join(root, f)))
  return {"path": path, "bytes": size, "state": "warm" if size > 100e6 else "cold"}


def clone(commit: str, into: str) -> str:
  """A fresh clone of this repository at `commit` in `into`; its full sha."""
  subprocess.run(["git", "clone", "-q", REPO, into], check=True)
  subprocess.run(["git", "checkout", "-q", commit], cwd=into, check=True)
  return subprocess.run(["git", "rev-parse", "HEAD"], cwd=into, check=True,
                        capture_output=True, text=True).stdout.strip()


def pytest_summary(output: str) -> dict:
  """The counts and seconds of pytest's last summary line ("N passed, M skipped in S s")."""
  lines = [l for l in output.splitlines() if re.search(r" in [0-9.]+s", l)
           and re.search(r"\d+ (passed|failed)", l)]
  if not lines:
    return {}
  last = lines[-1]
  out = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                  last)}
  out["pytest_s"] = float(re.search(r" in ([0-9.]+)s", last).group(1))
  return out
