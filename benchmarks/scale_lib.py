"""The scale table's library: every GPT-2 preset's train step compiled ahead of time.

Compiler estimates, not measurements: no TPU runs here. For each target (a TPU topology and
mesh), preset (small/medium/large/xl), kind (PRISM, dense) and remat (off/on) it finds the
largest per-chip batch whose compiled step fits the chip's HBM (doubling, then bisection
down to --resolution; libtpu's compile-only devices, benchmarks/compile_check.py), and
records from that compile: the per-chip HBM peak (memory_analysis), FLOPs and bytes
accessed (cost_analysis), the collectives of the step's HLO (benchmarks/hlo_collectives.py)
and whether any moves a (tokens x K) matrix. Rows then add the roofline step time
max(FLOPs / peak, bytes / HBM bandwidth) from the chip's published figures (CHIPS),
tokens/s/chip, MFU (the analytic FLOPs of prism_jax/flops.py over that time and the peak)
and PRISM/dense throughput at each one's largest batch.

The command is benchmarks/scale_table.py; this is its library (importable without flags).
Every compile result is cached (Cache: keyed by `code_key()`, target, shape and batch), so
an interrupted run resumes and a rerun compiles nothing while the code that builds the
program is unchanged: commits that touch only docs or tests keep the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

# Compile-only: no TPU is opened, so other compiling processes (tests) may hold libtpu too.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from benchmarks import compile_check  # noqa: E402  sets the compile-only environment

from benchmarks import hlo_collectives  # noqa: E402  pylint: disable=wrong-import-order

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


def _is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text


def measure(target: Target, preset_name: str, kind: str, remat: bool, seq_len: int,
            per_chip_batch: int) -> dict[str, Any]:
  """One AOT compile -> what the table reads from it (fits False on an HBM overflow)."""
  import jax  # pylint: disable=import-outside-toplevel
  from prism_jax import sharding  # pylint: disable=import-outside-toplevel
  from prism_jax.config import MeshConfig  # pylint: disable=import-outside-toplevel
  chip = CHIPS[target.chip]
  start = time.perf_counter()
  # implementation None: the model's default resolved for the platform compiled for (the
  # Mosaic kernel on TPU), what a TPU run gets
  lowered, cfg, state, devices = compile_check.lower_train_step(
      preset_name, target.topology, target.mesh, per_chip_batch, seq_len, "bfloat16", remat,
      kind, None)
  try:
    with jax.set_mesh(sharding.make_mesh(MeshConfig(*target.mesh), devices)):
      compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    if not _is_oom(e):
      raise
    return {"fits": False, "error": " ".join(str(e).split())[:300]}
  compile_s = time.perf_counter() - start
  mesh_shape = sharding.resolve_mesh_shape(MeshConfig(*target.mesh), len(devices))
  text = compiled.as_text()
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  peak = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes)
  ops = hlo_collectives.collectives(text)
  k = cfg.model.num_prototypes
  proto_dims = {k, k // mesh_shape[2]}
  with_k = hlo_collectives.with_proto_dim(ops, proto_dims)
  return {
      "fits": peak <= chip.hbm_bytes, "peak_bytes": peak,
      "argument_bytes": int(mem.argument_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "flops": float(cost.get("flops", 0.0)),
      "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
      "collectives": hlo_collectives.summary(ops),
      # every collective with a prototype axis: the N x K check reads them (row_for)
      "proto_collectives": [[op.kind, op.operands, op.results, op.bytes] for op in with_k],
      "proto_dims": sorted(proto_dims), "d_model": cfg.model.d_model,
      "mesh_shape": list(mesh_shape), "chips": len(devices),
      "device_kind": devices[0].device_kind,
      "params": sum(int(x.size) for x in jax.tree.leaves(state.params)),
      "optimization_barriers": text.count("opt-barrier"),
      "mosaic_calls": text.count("tpu_custom_call"), "compile_s": round(compile_s, 1),
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
  refuted = 0  # affine guesses in a row that did not fit
  while hi - lo > max(1, int(resolution * lo)):
    # two refuted guesses say the peak is not affine here (XLA's schedule changes with b:
    # `small` measured 14.51 -> 14.62 GiB from b 13 to 14, then 26 overflowed): bisect,
    # rather than walk down from hi one batch at a time
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
    elif hi == before:
      refuted = 0
  return lo


# What determines the compiled program: the library, the kernels and the lowering code.
CODE_PATHS = ("prism_jax", "pallas_kernels", "benchmarks/compile_check.py",
              "benchmarks/scale_lib.py", "benchmarks/hlo_collectives.py", "setup.cfg")


def code_key(root: str | None = None) -> str:
  """A hash of CODE_PATHS as tracked (blob ids) plus any uncommitted change to them, and of
  the jax/jaxlib/libtpu versions: two states that compile the same program share it."""
  import hashlib  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def git(*args):
    return subprocess.run(["git", "-C", root, *args, "--", *CODE_PATHS], capture_output=True,
                          text=True, check=True).stdout
  versions = []
  for dist in ("jax", "jaxlib", "libtpu"):
    try:
      versions.append(f"{dist}=={metadata.version(dist)}")
    except metadata.PackageNotFoundError:
      versions.append(f"{dist} absent")
  text = git("ls-files", "-s") + git("diff", "HEAD") + " ".join(versions)
  return "code." + hashlib.sha256(text.encode()).hexdigest()[:16]


class Cache:
  """Compile results on disk, one JSON object keyed by code|target|preset|kind|remat|T|b
  (`code` is code_key(): a rerun after a docs-only commit reuses every entry)."""

  def __init__(self, path: str, code: str):
    self.path, self.code = path, code
    self.entries: dict[str, Any] = {}
    if os.path.exists(path):
      with open(path) as f:
        self.entries = json.load(f)
    self.new = 0

  def key(self, *parts) -> str:
    return "|".join(str(p) for p in (self.code,) + parts)

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
  with_k = [hlo_collectives.Collective(op, tuple(map(tuple, ins)), tuple(map(tuple, outs)), n)
            for op, ins, outs, n in m["proto_collectives"]]
  nxk = hlo_collectives.moves_tokens_by_protos(with_k, set(m["proto_dims"]), seq_len,
                                               m["d_model"])
  t_compute = m["flops"] / chip.peak_flops
  t_memory = m["bytes_accessed"] / chip.hbm_bandwidth
  t_step = max(t_compute, t_memory)
  tokens_s = tokens_per_chip / t_step
  return dict(row, fits=True, mesh_shape=m["mesh_shape"], chips=m["chips"],
              device_kind=m["device_kind"], params=m["params"],
              peak_GiB=m["peak_bytes"] / GIB, hbm_GiB=chip.hbm_bytes / GIB,
              compiled_TFLOP=m["flops"] / 1e12, analytic_TFLOP=analytic / 1e12,
              bytes_accessed_GB=m["bytes_accessed"] / 1e9, collectives=m["collectives"],
              proto_collectives=m["proto_collectives"][:24],
              nxk_collectives=[[op.kind, op.operands, op.results] for op in nxk],
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


def _fits_and_peak(m: dict) -> tuple[bool, float | None]:
  return m["fits"], m.get("peak_bytes")


def build(cache: Cache, targets, presets, kinds, remats, seq_len, start, max_batch,
          resolution, max_compiles, log=print) -> list[dict]:
  rows = []
  for name in presets:  # preset outermost: a cut-short run has whole presets, smallest first
    for tname in targets:
      target = TARGETS[tname]
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
            batch = largest_fitting(lambda b: _fits_and_peak(result(b)),
                                    CHIPS[target.chip].hbm_bytes, start, max_batch, resolution)
          except BudgetSpent:
            log(f"--max_compiles reached: {tname} {name} {kind} remat={remat} not searched")
            return rows
          rows.append(row_for(target, name, kind, remat, seq_len, batch,
                              None if batch is None else result(batch)))
  return rows
