"""The scale table: the train step of every GPT-2 preset compiled ahead of time for TPU pods.

Compiler estimates, not measurements: no TPU runs here. For each target (a TPU topology and
mesh), preset (small/medium/large/xl), kind (PRISM, dense) and remat (off/on) it finds the
largest per-chip batch whose compiled step fits the chip's HBM (doubling, then bisection
down to --resolution; libtpu's compile-only devices, experiments/compile_check.py), and
records from that compile: the per-chip HBM peak (memory_analysis), FLOPs and bytes
accessed (cost_analysis), the collectives of the step's HLO (benchmarks/hlo_collectives.py)
and whether any moves a (tokens x K) matrix. Rows then add the roofline step time
max(FLOPs / peak, bytes / HBM bandwidth) from the chip's published figures (CHIPS),
tokens/s/chip, MFU (the analytic FLOPs of prism_jax/flops.py over that time and the peak)
and PRISM/dense throughput at each one's largest batch.

  nice -n 10 python -m benchmarks.scale_table --json=docs/results/scale_table.json
  python -m experiments.reproduce      # renders it into docs/RESULTS.md "Scale table"

Every compile result is cached in --cache (keyed by the git commit, target, shape and
batch), so an interrupted run resumes and a rerun on the same commit compiles nothing.
Needs libtpu (`pip install -e ".[tpu-aot]"`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from experiments import compile_check  # sets the compile-only environment first

from absl import flags  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-order

from benchmarks import hlo_collectives  # noqa: E402
from experiments import cli  # noqa: E402

FLAGS = flags.FLAGS
GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  peak_flops: float  # dense bf16 FLOP/s
  hbm_bandwidth: float  # bytes/s
  hbm_bytes: int
  source: str


# Google Cloud TPU docs (cloud.google.com/tpu/docs/v5e, /v5p): bf16 peak, HBM bandwidth, HBM.
CHIPS = {
    "v5e": Chip(197e12, 819e9, 16 * GIB, "Google Cloud TPU docs, v5e: 197 TFLOP/s bf16, "
                "819 GB/s HBM, 16 GiB HBM per chip"),
    "v5p": Chip(459e12, 2765e9, 95 * GIB, "Google Cloud TPU docs, v5p: 459 TFLOP/s bf16, "
                "2765 GB/s HBM, 95 GiB HBM per chip"),
}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  topology: str
  mesh: tuple[int, int, int]  # data, fsdp, model (compile_check's --mesh)
  chip: str

  @property
  def model_axis(self) -> int:
    return self.mesh[2]


TARGETS = {t.name: t for t in (
    Target("v5e-16 fsdp", "v5e:4x4", (1, -1, 1), "v5e"),
    Target("v5p-8 fsdp+K/2", "v5p:2x2x2", (1, -1, 2), "v5p"),
    # small shapes for the script's own test
    Target("v5e-4 fsdp", "v5e:2x2", (1, -1, 1), "v5e"),
    Target("v5p-4 fsdp+K/2", "v5p:2x2x1", (1, -1, 2), "v5p"),
)}
DEFAULT_TARGETS = ("v5e-16 fsdp", "v5p-8 fsdp+K/2")


def define_flags() -> None:
  flags.DEFINE_list("targets", list(DEFAULT_TARGETS), f"of {sorted(TARGETS)}")
  flags.DEFINE_list("presets", ["small", "medium", "large", "xl"], "model presets")
  flags.DEFINE_list("kinds", ["prism", "dense"], "prism and/or dense")
  flags.DEFINE_list("remat", ["off", "on"], "rematerialise blocks: off and/or on")
  flags.DEFINE_integer("seq_len", 1024, "sequence length (the GPT-2 presets' context)")
  flags.DEFINE_integer("max_batch", 256, "largest per-chip batch tried")
  flags.DEFINE_integer("start_batch", 1, "per-chip batch the search starts at (a power of 2)")
  flags.DEFINE_float("resolution", 0.25, "bisection stops when hi - lo <= max(1, this x lo)")
  flags.DEFINE_integer("max_compiles", 0, "stop after this many new compiles (0: no limit)")
  flags.DEFINE_string("cache", "runs/scale_table_cache.json", "every compile's result")
  flags.DEFINE_string("json", None, "write the table's rows here")


def git_commit() -> str:
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "prism_jax",
                            "pallas_kernels", "experiments/compile_check.py"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def _is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text


def measure(target: Target, preset_name: str, kind: str, remat: bool, seq_len: int,
            per_chip_batch: int) -> dict[str, Any]:
  """One AOT compile -> what the table reads from it (fits False on an HBM overflow)."""
  chip = CHIPS[target.chip]
  try:
    c = compile_check.compile_step(preset_name, target.topology, target.mesh, per_chip_batch,
                                   seq_len, "bfloat16", remat, kind,
                                   "pallas_tpu" if kind == "prism" else "xla")
  except Exception as e:  # pylint: disable=broad-except
    if not _is_oom(e):
      raise
    return {"fits": False, "error": " ".join(str(e).split())[:300]}
  mem = c.compiled.memory_analysis()
  cost = c.compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  peak = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes)
  ops = hlo_collectives.collectives(c.compiled.as_text())
  k = c.cfg.model.num_prototypes
  proto_dims = {k, k // c.mesh_shape[2]}
  with_k = hlo_collectives.with_proto_dim(ops, proto_dims)
  nxk = hlo_collectives.moves_tokens_by_protos(ops, proto_dims, seq_len, c.cfg.model.d_model)
  return {
      "fits": peak <= chip.hbm_bytes, "peak_bytes": peak,
      "argument_bytes": int(mem.argument_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "flops": float(cost.get("flops", 0.0)),
      "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
      "collectives": hlo_collectives.summary(ops),
      "proto_collectives": [[op.kind, op.operands, op.results] for op in with_k][:24],
      "nxk_collectives": [[op.kind, op.operands, op.results] for op in nxk],
      "mesh_shape": list(c.mesh_shape), "chips": len(c.devices),
      "device_kind": c.devices[0].device_kind, "params": c.params,
      "optimization_barriers": c.compiled.as_text().count("opt-barrier"),
      "compile_s": round(c.compile_s, 1),
  }


def largest_fitting(probe: Callable[[int], tuple[bool, float | None]], limit: float,
                    start: int, max_batch: int, resolution: float) -> int | None:
  """The largest b <= max_batch that fits (probe(b) = (fits, peak bytes or None); fits is
  monotone, true up to some b*), within max(1, resolution x b).

  Doubling (halving when `start` does not fit) brackets b*, bisection narrows the bracket.
  Once two compiled batches have a peak, each probe is instead placed where the line
  through them meets `limit` (the peak is close to affine in the batch: state + b x
  activations), kept inside the bracket: a handful of compiles instead of ~2 log2(b*).
  None when even 1 does not fit."""
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
    if len(peaks) < 2:
      return None
    (b1, p1), (b2, p2) = sorted(peaks.items())[-2:]
    slope = (p2 - p1) / (b2 - b1)
    return None if slope <= 0 else int(b2 + (limit - p2) / slope)

  step(max(1, min(start, max_batch)))
  while lo == 0:  # start did not fit: halve
    if hi == 1:
      return None
    step(hi // 2)
  while hi - lo > max(1, int(resolution * lo)):
    guess = predicted()
    if hi == max_batch + 1 and guess is None:
      nxt = min(2 * lo, max_batch)  # doubling
    elif guess is None:
      nxt = (lo + hi) // 2  # bisection
    else:  # the affine guess; at or below lo: test just above lo, by the resolution
      nxt = guess if guess > lo else lo + max(1, int(resolution * lo))
      nxt = min(max(nxt, lo + 1), hi - 1)
    step(nxt)
  return lo


class Cache:
  """Compile results on disk, one JSON object keyed by commit|target|preset|kind|remat|T|b."""

  def __init__(self, path: str, commit: str):
    self.path, self.commit = path, commit
    self.entries: dict[str, Any] = {}
    if os.path.exists(path):
      with open(path) as f:
        self.entries = json.load(f)
    self.new = 0

  def key(self, *parts) -> str:
    return "|".join(str(p) for p in (self.commit,) + parts)

  def get(self, key: str, compute: Callable[[], dict]) -> dict:
    if key not in self.entries:
      self.entries[key] = compute()
      self.new += 1
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(self.entries, f, indent=1, sort_keys=True)
      os.replace(tmp, self.path)
    return self.entries[key]


class BudgetSpent(Exception):
  pass


def row_for(target: Target, preset_name: str, kind: str, remat: bool, seq_len: int,
            batch: int | None, m: dict | None) -> dict[str, Any]:
  """A table row from the compile at the largest fitting batch (figures named by source)."""
  from prism_jax import flops  # pylint: disable=import-outside-toplevel
  from prism_jax.config import preset  # pylint: disable=import-outside-toplevel
  chip = CHIPS[target.chip]
  row = {"target": target.name, "topology": target.topology, "preset": preset_name,
         "kind": kind, "remat": remat, "seq_len": seq_len, "per_chip_batch": batch}
  if batch is None or m is None:
    return dict(row, fits=False)
  cfg = preset(preset_name)
  model = dataclasses.replace(cfg.model, kind=kind)
  tokens_per_chip = batch * seq_len  # global batch = per-chip batch x chips
  analytic = flops.flops_per_token(model, seq_len, cfg.loss)["train"] * tokens_per_chip
  t_compute = m["flops"] / chip.peak_flops
  t_memory = m["bytes_accessed"] / chip.hbm_bandwidth
  t_step = max(t_compute, t_memory)
  tokens_s = tokens_per_chip / t_step
  return dict(row, fits=True, mesh_shape=m["mesh_shape"], chips=m["chips"],
              device_kind=m["device_kind"], params=m["params"],
              peak_GiB=m["peak_bytes"] / GIB, hbm_GiB=chip.hbm_bytes / GIB,
              compiled_TFLOP=m["flops"] / 1e12, analytic_TFLOP=analytic / 1e12,
              bytes_accessed_GB=m["bytes_accessed"] / 1e9, collectives=m["collectives"],
              proto_collectives=m["proto_collectives"], nxk_collectives=m["nxk_collectives"],
              optimization_barriers=m["optimization_barriers"],
              roofline_compute_ms=1e3 * t_compute, roofline_memory_ms=1e3 * t_memory,
              roofline_step_ms=1e3 * t_step,
              bound="compute" if t_compute >= t_memory else "memory",
              tokens_per_s_per_chip=tokens_s, mfu=analytic / t_step / chip.peak_flops)


def ratios(rows: list[dict]) -> list[dict]:
  """PRISM/dense predicted tokens/s/chip, each at its largest batch, per target x preset x
  remat (the paper: 97.3% at XL on H200, measured)."""
  by = {(r["target"], r["preset"], r["remat"], r["kind"]): r for r in rows if r["fits"]}
  out = []
  for (target, name, remat, kind), r in by.items():
    dense = by.get((target, name, remat, "dense"))
    if kind == "prism" and dense is not None:
      out.append({"target": target, "preset": name, "remat": remat,
                  "prism_over_dense": r["tokens_per_s_per_chip"]
                  / dense["tokens_per_s_per_chip"]})
  return out


def build(cache: Cache, targets, presets, kinds, remats, seq_len, start, max_batch,
          resolution, max_compiles, log=print) -> list[dict]:
  rows = []
  for tname in targets:
    target = TARGETS[tname]
    for name in presets:
      for kind in kinds:
        for remat in remats:
          def result(b, target=target, name=name, kind=kind, remat=remat):
            key = cache.key(target.topology, target.mesh, name, kind, remat, seq_len, b)
            if key not in cache.entries and max_compiles and cache.new >= max_compiles:
              raise BudgetSpent
            t0 = time.time()
            m = cache.get(key, lambda: measure(target, name, kind, remat, seq_len, b))
            log(f"  {tname} {name} {kind} remat={remat} b={b}: "
                + (f"peak {m['peak_bytes'] / GIB:.2f} GiB" if "peak_bytes" in m else "HBM overflow")
                + f" fits={m['fits']} ({time.time() - t0:.0f} s)")
            return m
          try:
            batch = largest_fitting(lambda b: (lambda m: (m["fits"], m.get("peak_bytes")))(result(b)),
                                    CHIPS[target.chip].hbm_bytes, start, max_batch, resolution)
          except BudgetSpent:
            log(f"--max_compiles reached: {tname} {name} {kind} remat={remat} not searched")
            return rows
          rows.append(row_for(target, name, kind, remat, seq_len, batch,
                              None if batch is None else result(batch)))
  return rows


def main(argv: list[str]) -> None:
  del argv
  from experiments import reproduce_sources  # pylint: disable=import-outside-toplevel
  bad = [t for t in FLAGS.targets if t not in TARGETS]
  if bad:
    raise ValueError(f"unknown --targets {bad}; choose from {sorted(TARGETS)}")
  if set(FLAGS.remat) - {"off", "on"} or set(FLAGS.kinds) - {"prism", "dense"}:
    raise ValueError("--remat takes off,on and --kinds prism,dense")
  commit = git_commit()
  cache = Cache(FLAGS.cache, commit)
  start = time.time()
  cpu0 = os.times()
  rows = build(cache, FLAGS.targets, FLAGS.presets, FLAGS.kinds,
               [r == "on" for r in FLAGS.remat], FLAGS.seq_len, FLAGS.start_batch,
               FLAGS.max_batch, FLAGS.resolution, FLAGS.max_compiles)
  cpu1 = os.times()
  data = {"argv": sys.argv, "commit": commit,
          "command": "nice -n 10 python -m benchmarks.scale_table " + " ".join(sys.argv[1:]),
          "note": "compiler estimates from AOT compiles (libtpu compile-only devices), "
                  "not measurements on a TPU",
          "chips": {k: dataclasses.asdict(v) for k, v in CHIPS.items()},
          "targets": {t: dataclasses.asdict(TARGETS[t]) for t in FLAGS.targets},
          "resolution": FLAGS.resolution, "max_batch": FLAGS.max_batch,
          "new_compiles": cache.new, "wall_s": round(time.time() - start),
          "cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system),
          "rows": rows, "ratios": ratios(rows)}
  print(reproduce_sources.scale_table_markdown(data))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(data, f, indent=1)
    print(f"wrote {FLAGS.json} ({cache.new} new compiles, {data['cpu_s']} CPU s)")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
