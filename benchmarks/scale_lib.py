"""The scale table's library: every GPT-2 preset's train step compiled ahead of time.

Compiler estimates, not measurements: no TPU runs here. For each target (a TPU topology and
mesh), preset (small/medium/large/xl), kind (PRISM, dense) and remat (off/on) it finds the
largest per-chip batch whose compiled step fits the chip's HBM (a first guess from peaks
extrapolated in depth from 2- and 4-block compiles, then a search of full-depth compiles
from it: libtpu's compile-only devices, benchmarks/scale_measure.py), and records from the
full-depth compile at that batch: the per-chip HBM peak (memory_analysis), FLOPs and bytes
accessed (cost_analysis), the collectives of the step's HLO (benchmarks/hlo_collectives.py)
and whether any moves a (tokens x K) matrix. Rows then add the step time from the
chip's published figures (benchmarks/scale_roofline.py: compute, memory and collective
terms, collectives at full overlap and at none), tokens/s/chip, MFU (the analytic FLOPs of
prism_jax/flops.py over that time and the peak) and PRISM/dense throughput at each one's
largest batch; benchmarks/scale_accum.py derives the recipes' accumulated steps from them.

The command is benchmarks/scale_table.py; this is its library (importable without flags).
Every compile result is cached (Cache: keyed by the lowered program itself), so an
interrupted run resumes, and a rerun compiles only programs that changed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from benchmarks import scale_measure  # sets the compile-only environment before jax loads

from benchmarks.scale_roofline import (  # noqa: E402,F401  (the table's names, re-exported)
    CHIPS, DEFAULT_TARGETS, GIB, TARGETS, Chip, Target, ratios, row_for)
from prism_jax.cli import provenance  # noqa: E402  pylint: disable=wrong-import-order
from prism_jax.config import preset  # noqa: E402  pylint: disable=wrong-import-order


def largest_fitting(probe: Callable[[int], tuple[bool, float | None]], limit: float,
                    start: int, max_batch: int, resolution: float,
                    slope_hint: float | None = None) -> int | None:
  """The largest b <= max_batch that fits (probe(b) = (fits, peak bytes or None); fits is
  monotone, true up to some b*), within max(1, resolution x b).

  Doubling (halving when `start` does not fit) brackets b*, bisection narrows the bracket.
  Once two compiled batches have a peak, each probe is instead placed where the line
  through them meets `limit` (the peak is close to affine in the batch: state + b x
  activations), kept inside the bracket: a handful of compiles instead of ~2 log2(b*).
  `slope_hint` (bytes per batch row) places the probe after the first peak the same way.
  After two guesses that overflowed, bisection only. None when even 1 does not fit."""
  peaks: dict[int, float] = {}
  lo, hi = 0, max_batch + 1  # lo fits (0: none yet), hi does not

  def step(b: int) -> None:
    nonlocal lo, hi
    fits, peak = probe(b)
    if peak is not None:
      peaks[b] = peak
    if fits:
      lo = b
    else:
      hi = b

  def predicted() -> int | None:
    if len(peaks) >= 2:
      (b1, p1), (b2, p2) = sorted(peaks.items())[-2:]
      slope = (p2 - p1) / (b2 - b1)
    elif peaks and slope_hint is not None:
      (b2, p2), slope = next(iter(peaks.items())), slope_hint
    else:
      return None
    return None if slope <= 0 else int(b2 + (limit - p2) / slope)

  step(max(1, min(start, max_batch)))
  while lo == 0:  # start did not fit: halve
    if hi == 1:
      return None
    step(hi // 2)
  refuted = 0  # affine guesses that overflowed (two: bisection from then on)
  while hi - lo > max(1, int(resolution * lo)):
    # two refuted guesses say the peak is not affine here (XLA's schedule changes with b:
    # `small` measured 14.51 -> 14.62 GiB from b 13 to 14, then 26 overflowed): bisect from
    # then on, rather than walk down from hi one batch at a time
    guess = None if refuted >= 2 else predicted()
    if hi == max_batch + 1 and guess is None:
      nxt = min(2 * lo, max_batch)  # doubling
    elif guess is None:
      nxt = (lo + hi) // 2  # bisection
    else:  # the affine guess; at or below lo: test just above lo, by the resolution
      nxt = guess if guess > lo else lo + max(1, int(resolution * lo))
      nxt = min(max(nxt, lo + 1), hi - 1)
    before = hi
    step(nxt)
    if hi < before and guess is not None:
      refuted += 1
  return lo


# The code that builds the program: the index from a search's probe to its program.
CODE_PATHS = ("prism_jax", "pallas_kernels", "benchmarks/compile_check.py", "setup.cfg")


def code_key(root: str | None = None) -> str:
  """A hash of CODE_PATHS as tracked (blob ids) plus any uncommitted change to them: while
  it holds, a probe's program is looked up without lowering it again."""
  import hashlib  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def git(*args):
    return subprocess.run(["git", "-C", root, *args, "--", *CODE_PATHS], capture_output=True,
                          text=True, check=True).stdout
  text = git("ls-files", "-s") + git("diff", "HEAD")
  return "code." + hashlib.sha256(text.encode()).hexdigest()[:16]


class Cache:
  """Compile results on disk: `programs` keyed by scale_measure.program_key (the lowered
  program itself), and `index` from code_key|target|preset|kind|remat|T|b|blocks to that
  key. A code change re-lowers (seconds) and compiles only programs that changed. Each save
  merges with the file under a lock, so searches run in parallel share one cache; the
  default file is tracked, so a commit keeps the compiles (hours of CPU) a lost machine
  would otherwise take with it."""

  def __init__(self, path: str, code: str):
    self.path, self.code = path, code
    self.programs: dict[str, Any] = {}
    self.index: dict[str, str] = {}
    self._merge(self._read())
    self.new = 0
    self.fresh: set[str] = set()  # the programs compiled by this process

  def _read(self) -> dict:
    if not os.path.exists(self.path):
      return {}
    with open(self.path) as f:
      return json.load(f)

  def _merge(self, data: dict) -> None:
    if "programs" in data:  # older files keyed by commit: nothing reusable
      self.programs = {**data["programs"], **self.programs}
      self.index = {**data["index"], **self.index}

  def key(self, *parts) -> str:
    return "|".join(str(p) for p in (self.code,) + parts)

  def _save(self) -> None:
    import fcntl  # pylint: disable=import-outside-toplevel
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    with open(self.path + ".lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # another search may have saved since we read
      self._merge(self._read())
      provenance.write_json(self.path, {"programs": self.programs, "index": self.index},
                            sort_keys=True)

  def peek(self, key: str) -> dict | None:
    """The result for `key` if it is cached (nothing lowered or compiled)."""
    return self.programs[self.index[key]] if key in self.index else None

  def get(self, key: str, lower: Callable[[], tuple[str, Callable[[], dict]]],
          may_compile: Callable[[], bool] = lambda: True) -> dict:
    """The result for `key`; else lower() -> (program key, compile): compiled only when that
    program is new (and may_compile(): else BudgetSpent)."""
    if key not in self.index:
      program, compile_ = lower()
      if program not in self.programs:
        if not may_compile():
          raise BudgetSpent
        self.programs[program] = compile_()
        self.new += 1
        self.fresh.add(program)
      self.index[key] = program
      self._save()
    return self.programs[self.index[key]]


class BudgetSpent(Exception):
  pass


def _fits_and_peak(m: dict) -> tuple[bool, float | None]:
  return m["fits"], m.get("peak_bytes")


def in_depth(shallow: dict[int, dict], n_layers: int, limit: float) -> tuple[bool, float | None]:
  """(fits, peak) at `n_layers` blocks from compiles of the same step at two smaller depths:
  the peak is affine in the depth (each block adds its weights, optimizer state and saved
  activations). An overflow at a smaller depth is one at every larger depth."""
  (l1, m1), (l2, m2) = sorted(shallow.items())
  if not (m1["fits"] and m2["fits"]):
    return False, None
  p1, p2 = m1["peak_bytes"], m2["peak_bytes"]
  peak = p2 + (p2 - p1) * (n_layers - l2) / (l2 - l1)
  return peak <= limit, peak


def search_in_depth(result: Callable[[int, int], dict], full: int, shallow: tuple[int, int],
                    limit: float, start: int, max_batch: int, resolution: float
                    ) -> tuple[int | None, str]:
  """(batch, why not batch + 1): largest_fitting on peaks extrapolated in depth (in_depth,
  within `resolution`) gives a first guess, compiled at full depth; then an exact
  full-depth search below it (when it overflows) or above it, its first probe placed by
  the extrapolated line's slope in b. Near the limit XLA rematerialises to fit, so
  compiled peaks flatten (`small` with remat: 14.48 GiB at b 34, 14.06 at b 39) and the
  search ends in bisection. Overflows are cheap (`small`: ~25 s at full depth, XLA stops
  at buffer assignment; a fit takes 100-150 s, and a 4-block fit at b 26 as long), so no
  shallow compile bounds it from above. The reason names what overflowed at b + 1 and at
  which depth (compiled), or max_batch."""
  at_depth = lambda b: {l: result(b, l) for l in shallow}
  full_at = lambda b: _fits_and_peak(result(b, full))

  def shallow_overflow(b: int) -> str | None:
    """The reason when a smaller depth overflows at b (and so every larger depth)."""
    over = [l for l, m in sorted(at_depth(b).items()) if not m["fits"]]
    return f"b {b} overflows at {over[0]} blocks (compiled)" if over else None

  guess = largest_fitting(lambda b: in_depth(at_depth(b), full, limit), limit, start,
                          max_batch, resolution)
  if guess is None:  # the line is over the HBM at b 1; the full depth may still fit
    if why := shallow_overflow(1):
      return None, why
    guess = 1
  if not result(guess, full)["fits"]:
    batch = largest_fitting(full_at, limit, max(1, guess - 1), guess - 1, 0.0) \
        if guess > 1 else None
    if batch is None:
      return None, "b 1 overflows at full depth (compiled)"
    return batch, f"b {batch + 1} overflows at full depth (compiled)"
  if guess == max_batch:
    return guess, "max_batch"
  # the slope hint from the shallow compiles at guess + 1, which the exact (resolution 0)
  # search made already; at a coarser resolution no compile is spent on it
  hint = None
  if resolution == 0:
    if why := shallow_overflow(guess + 1):
      return guess, why
    line = lambda b: in_depth(at_depth(b), full, limit)[1]  # both depths fit at both
    hint = line(guess + 1) - line(guess)
  batch = largest_fitting(full_at, limit, guess, max_batch, 0.0, slope_hint=hint)
  return batch, ("max_batch" if batch == max_batch else
                 f"b {batch + 1} overflows at full depth (compiled)")


def build(cache: Cache, targets, presets, kinds, remats, seq_len, start, max_batch,
          resolution, max_compiles, shallow=(2, 4), log=print) -> list[dict]:
  """The rows, a search per target x preset x kind x remat (presets outermost: a cut-short
  run has whole presets, smallest first). With `shallow` (two block counts) a first guess
  comes from peaks extrapolated in depth from compiles at those depths, and full-depth
  compiles search from it (search_in_depth); every figure of a row is the full-depth
  compile's at its batch. max_compiles -1: the cache alone."""
  rows = []
  for name in presets:
    for tname in targets:
      target = TARGETS[tname]
      limit = CHIPS[target.chip].hbm_bytes
      full = preset(name).model.n_layers
      for kind in kinds:
        for remat in remats:
          def key_of(b, layers, target=target, name=name, kind=kind, remat=remat):
            return cache.key(target.topology, target.mesh, name, kind, remat, seq_len, b,
                             layers)

          def result(b, layers, target=target, name=name, kind=kind, remat=remat):
            key = key_of(b, layers)

            def lower():
              lowered, cfg, state, devices = scale_measure.lower(
                  target.topology, target.mesh, name, kind, remat, seq_len, b, layers)
              program = scale_measure.program_key(lowered, target.topology, target.mesh)
              return program, lambda: scale_measure.compile_and_read(
                  lowered, cfg, state, devices, target.mesh, limit)

            def may_compile():
              return max_compiles >= 0 and not (max_compiles and cache.new >= max_compiles)
            t0 = time.time()
            m = cache.get(key, lower, may_compile)
            log(f"  {tname} {name} {kind} remat={remat} b={b} blocks={layers}: "
                + (f"peak {m['peak_bytes'] / GIB:.2f} GiB" if "peak_bytes" in m else "HBM overflow")
                + f" fits={m['fits']} ({time.time() - t0:.0f} s)")
            return m
          use_shallow = shallow and full > max(shallow)
          try:
            if use_shallow:
              batch, above = search_in_depth(result, full, shallow, limit, start, max_batch,
                                             resolution)
            else:
              batch = largest_fitting(lambda b: _fits_and_peak(result(b, full)), limit,
                                      start, max_batch, resolution)
          except BudgetSpent:
            log(f"no compile allowed (--max_compiles): {tname} {name} {kind} remat={remat} "
                "not searched")
            return rows
          row = row_for(target, name, kind, remat, seq_len, batch,
                        None if batch is None else result(batch, full))
          if batch is not None:  # which compile the row reads, and whether it is new
            row["program"] = cache.index[key_of(batch, full)]
            row["compiled_this_run"] = row["program"] in cache.fresh
          if use_shallow and batch is not None:
            row["batch_search"] = (f"full-depth compiles from the batch where peaks "
                                   f"extrapolated in depth from {shallow} blocks meet the HBM")
            # the line at the batch, where its compiles exist (not compiled for the row)
            at = {l: cache.peek(key_of(batch, l)) for l in shallow}
            line = None if None in at.values() else in_depth(at, full, limit)[1]
            row["extrapolated_peak_GiB"] = None if line is None else line / GIB
            row["batch_above"] = above
          rows.append(row)
  return rows
