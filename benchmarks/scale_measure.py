"""One AOT compile of the scale table: lower a preset's train step for a TPU target, key the
program, compile it and read what the table needs.

The cache of benchmarks/scale_lib.py keys results by `program_key`: a hash of the lowered
program's text (StableHLO, no source locations), the target, the jax/jaxlib/libtpu versions
and this file and hlo_collectives.py (what reads the compiled program). A change to
prism_jax that leaves the program as it was keeps every cached compile; lowering costs
seconds, compiling minutes (xl on v5e-16 with remat: 250 s).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from importlib import metadata
from typing import Any

# Compile-only: no TPU is opened, so other compiling processes (tests) may hold libtpu too.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from benchmarks import compile_check  # noqa: E402  sets the compile-only environment

from benchmarks import hlo_collectives  # noqa: E402  pylint: disable=wrong-import-order


def _is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text


def lower(topology: str, mesh: tuple[int, int, int], preset_name: str, kind: str, remat: bool,
          seq_len: int, per_chip_batch: int, n_layers: int = 0):
  """(lowered, cfg, state, devices): the preset's step, `n_layers` blocks (0: the preset's).

  implementation None: the model's default resolved for the platform compiled for (the
  Mosaic kernel on TPU), what a TPU run gets."""
  return compile_check.lower_train_step(preset_name, topology, mesh, per_chip_batch, seq_len,
                                        "bfloat16", remat, kind, None, n_layers)


def _versions() -> str:
  out = []
  for dist in ("jax", "jaxlib", "libtpu"):
    try:
      out.append(f"{dist}=={metadata.version(dist)}")
    except metadata.PackageNotFoundError:
      out.append(f"{dist} absent")
  return " ".join(out)


def _reader_source() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  text = ""
  for name in ("scale_measure.py", "hlo_collectives.py"):
    with open(os.path.join(here, name)) as f:
      text += f.read()
  return text


# A Mosaic kernel's call carries its source locations (file paths, line numbers) for
# debugging: left out of the key, so a checkout elsewhere or moved lines keep the cache.
_DEBUG_LOCATIONS = re.compile(r"\\22debug_locations\\22: \\22[A-Za-z0-9+/=]*\\22")


def program_text(lowered) -> str:
  """The lowered program (StableHLO) without debug information."""
  return _DEBUG_LOCATIONS.sub("", lowered.as_text())


def program_key(lowered, topology: str, mesh) -> str:
  """Same key <=> same program compiled for the same target and read the same way."""
  h = hashlib.sha256()
  for part in (program_text(lowered), topology, str(tuple(mesh)), _versions(), _reader_source()):
    h.update(part.encode())
    h.update(b"\0")
  return "program." + h.hexdigest()[:20]


def compile_and_read(lowered, cfg, state, devices, mesh, hbm_bytes: int) -> dict[str, Any]:
  """Compile -> what the table reads (fits False, no peak, on an HBM overflow)."""
  import jax  # pylint: disable=import-outside-toplevel
  from prism_jax import sharding  # pylint: disable=import-outside-toplevel
  from prism_jax.config import MeshConfig  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  try:
    with jax.set_mesh(sharding.make_mesh(MeshConfig(*mesh), devices)):
      compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    if not _is_oom(e):
      raise
    return {"fits": False, "error": " ".join(str(e).split())[:300],
            "compile_s": round(time.perf_counter() - start, 1)}
  compile_s = time.perf_counter() - start
  mesh_shape = sharding.resolve_mesh_shape(MeshConfig(*mesh), len(devices))
  text = compiled.as_text()
  read = compile_check.read_compiled(compiled)
  peak = read["peak_bytes"]
  ops = hlo_collectives.collectives(text)
  k = cfg.model.num_prototypes
  proto_dims = {k, k // mesh_shape[2]}
  with_k = hlo_collectives.with_proto_dim(ops, proto_dims)
  return {
      "fits": peak <= hbm_bytes, "peak_bytes": peak,
      **{k: read[k] for k in ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes")},
      "flops": read["flops"] or 0.0, "bytes_accessed": read["bytes_accessed"] or 0.0,
      "collectives": hlo_collectives.summary(ops),
      # every collective with a prototype axis: the N x K check reads them (row_for)
      "proto_collectives": [[op.kind, op.operands, op.results, op.bytes] for op in with_k],
      "proto_dims": sorted(proto_dims), "d_model": cfg.model.d_model,
      "n_layers": cfg.model.n_layers,
      "mesh_shape": list(mesh_shape), "chips": len(devices),
      "device_kind": devices[0].device_kind,
      "params": sum(int(x.size) for x in jax.tree.leaves(state.params)),
      "optimization_barriers": text.count("opt-barrier"),
      "mosaic_calls": text.count("tpu_custom_call"), "compile_s": round(compile_s, 1),
  }
