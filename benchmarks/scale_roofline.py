"""The scale table's predictions from one compile: the chips' published figures, the named
slices compiled, and a row's compute, memory and collective terms.

A row's step time per chip has three terms, each from the full-depth compile at its batch:
compute (XLA's FLOPs over the chip's bf16 peak), memory (XLA's bytes accessed over its HBM
bandwidth) and collectives (the bytes the step's collectives put on the chip's ICI links
over its ICI bandwidth: `collective_seconds`). Compute and memory overlap (the roofline);
collectives are given both ways: full overlap (the step is the largest term) and none (the
roofline plus the collective term). MFU is the analytic training FLOPs (prism_jax.flops:
3 x forward per token; remat's recomputation not counted) over the step and the peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import scale_measure  # noqa: F401  sets the compile-only environment first

from benchmarks import hlo_collectives  # noqa: E402  pylint: disable=wrong-import-order
from prism_jax.config import preset, slice_name  # noqa: E402  pylint: disable=wrong-import-order

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  peak_flops: float  # dense bf16 FLOP/s
  hbm_bandwidth: float  # bytes/s
  hbm_bytes: int
  ici_bandwidth: float  # bytes/s per chip, bidirectional: both directions of every port
  source: str


# Google Cloud TPU docs (cloud.google.com/tpu/docs/v5e, /v5p), each chip's specification
# table: bf16 peak, HBM bandwidth and size, "Bidirectional inter-chip interconnect (ICI)
# bandwidth (per chip)".
CHIPS = {
    "v5e": Chip(197e12, 819e9, 16 * GIB, 400e9,
                "Google Cloud TPU docs, v5e: 197 TFLOP/s bf16, 819 GB/s HBM, 16 GiB HBM, "
                "400 GB/s bidirectional ICI per chip (4 ports, 2D torus)"),
    "v5p": Chip(459e12, 2765e9, 95 * GIB, 1200e9,
                "Google Cloud TPU docs, v5p: 459 TFLOP/s bf16, 2765 GB/s HBM, 95 GiB HBM, "
                "1200 GB/s bidirectional ICI per chip (3D torus)"),
}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # the label: Google's slice name and the sharding
  topology: str  # what the compile cache is keyed on (with the mesh), never the label
  mesh: tuple[int, int, int]  # data, fsdp, model (compile_check's --mesh)
  chip: str

  @property
  def model_axis(self) -> int:
    return self.mesh[2]

  @property
  def slice(self) -> str:
    return slice_name(self.topology)


def _target(topology: str, mesh: tuple[int, int, int], chip: str, sharding: str) -> Target:
  return Target(f"{slice_name(topology)} {sharding}", topology, mesh, chip)


TARGETS = {t.name: t for t in (
    _target("v5e:4x4", (1, -1, 1), "v5e", "fsdp"),  # v5e-16: 16 chips
    _target("v5p:2x2x2", (1, -1, 2), "v5p", "fsdp+K/2"),  # v5p-16: 8 chips, 16 TensorCores
    # small shapes for the script's own test
    _target("v5e:2x2", (1, -1, 1), "v5e", "fsdp"),  # v5e-4
    _target("v5p:2x2x1", (1, -1, 2), "v5p", "fsdp+K/2"),  # v5p-8: 4 chips
)}
DEFAULT_TARGETS = ("v5e-16 fsdp", "v5p-16 fsdp+K/2")

# Bytes a chip sends per byte of an op's hlo_collectives size (the whole array it moves,
# per device): a ring all-gather, reduce-scatter or all-to-all over n chips sends (n-1)/n
# of it, an all-reduce (reduce-scatter, then all-gather) twice that. Taken at n -> inf: the
# compiled text gives no group size per op in the cache, so the term is over by n/(n-1)
# (7% on the 16-chip FSDP axis, 33% on v5p's 4, 2x on the 2-way model axis).
WIRE_FACTOR = {"all-gather": 1, "reduce-scatter": 1, "all-to-all": 1, "collective-permute": 1,
               "all-reduce": 2}


def collective_seconds(collectives: dict[str, dict[str, int]], chip: Chip
                       ) -> tuple[float, float]:
  """(bytes on the wire, seconds) of a step's collectives per chip: a chip sends and
  receives at once, so it sends at half its bidirectional ICI figure, every port busy (no
  contention or topology model: 2x2x2 and 4x4 slices are not full tori)."""
  wire = float(sum(WIRE_FACTOR[kind] * c["bytes"] for kind, c in collectives.items()))
  return wire, wire / (chip.ici_bandwidth / 2)


def step_terms(m: dict, chip: Chip) -> dict[str, float]:
  """The three terms (seconds) and the step at full overlap and at none."""
  compute = m["flops"] / chip.peak_flops
  memory = m["bytes_accessed"] / chip.hbm_bandwidth
  wire, coll = collective_seconds(m["collectives"], chip)
  roofline = max(compute, memory)
  return {"compute": compute, "memory": memory, "collective": coll, "wire": wire,
          "roofline": roofline, "overlap": max(roofline, coll), "no_overlap": roofline + coll}


def row_for(target: Target, preset_name: str, kind: str, remat: bool, seq_len: int,
            batch: int | None, m: dict | None) -> dict[str, Any]:
  """A table row from the compile at the largest fitting batch (figures named by source)."""
  from prism_jax import flops  # pylint: disable=import-outside-toplevel
  chip = CHIPS[target.chip]
  row = {"target": target.name, "slice": target.slice, "topology": target.topology,
         "preset": preset_name, "kind": kind, "remat": remat, "seq_len": seq_len,
         "per_chip_batch": batch}
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
  t = step_terms(m, chip)
  bound = max(("compute", "memory", "collective"), key=lambda k: t[k])
  return dict(row, fits=True, mesh_shape=m["mesh_shape"], chips=m["chips"],
              device_kind=m["device_kind"], params=m["params"],
              peak_GiB=m["peak_bytes"] / GIB, hbm_GiB=chip.hbm_bytes / GIB,
              compiled_TFLOP=m["flops"] / 1e12, analytic_TFLOP=analytic / 1e12,
              bytes_accessed_GB=m["bytes_accessed"] / 1e9, collectives=m["collectives"],
              collective_wire_GB=t["wire"] / 1e9,
              proto_collectives=m["proto_collectives"][:24],
              nxk_collectives=[[op.kind, op.operands, op.results] for op in nxk],
              optimization_barriers=m["optimization_barriers"],
              roofline_compute_ms=1e3 * t["compute"], roofline_memory_ms=1e3 * t["memory"],
              roofline_collective_ms=1e3 * t["collective"],
              roofline_step_ms=1e3 * t["roofline"],  # compute and memory alone
              step_ms=1e3 * t["overlap"], step_ms_no_overlap=1e3 * t["no_overlap"],
              bound=bound, tokens_per_s_per_chip=tokens_per_chip / t["overlap"],
              tokens_per_s_per_chip_no_overlap=tokens_per_chip / t["no_overlap"],
              mfu=analytic / t["overlap"] / chip.peak_flops,
              mfu_no_overlap=analytic / t["no_overlap"] / chip.peak_flops)


def ratios(rows: list[dict]) -> list[dict]:
  """PRISM/dense predicted tokens/s/chip, each at its largest batch, per target x preset x
  remat, at full overlap and at none (the paper: 97.3% at XL on H200, measured)."""
  by = {(r["target"], r["preset"], r["remat"], r["kind"]): r for r in rows if r["fits"]}
  out = []
  for (target, name, remat, kind), r in by.items():
    dense = by.get((target, name, remat, "dense"))
    if kind == "prism" and dense is not None:
      out.append({"target": target, "preset": name, "remat": remat,
                  "prism_over_dense": r["tokens_per_s_per_chip"]
                  / dense["tokens_per_s_per_chip"],
                  "prism_over_dense_no_overlap": r["tokens_per_s_per_chip_no_overlap"]
                  / dense["tokens_per_s_per_chip_no_overlap"]})
  return out
