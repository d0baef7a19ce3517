"""Ahead-of-time compile of the train step for a TPU topology, from a CPU box.

Needs libtpu (the `tpu-aot` extra: `pip install libtpu==0.0.51`); no TPU is used. For each
preset x topology it builds the abstract train state born sharded on a mesh of the
topology's (compile-only) devices, lowers and compiles the real jitted train step (the
K-sharded prototype layer included), and prints per-device memory (arguments,
temporaries, outputs, aliased/donated), the compiled FLOPs per device and whether the
step fits the chip's HBM.

  python -m benchmarks.compile_check --topology=v5e:4x4 --config=small
  python -m benchmarks.compile_check --topology=v5e:4x4,v5p:2x2x1 \
      --config=small,medium,large,xl --mesh=1,-1,1 --dtype=bfloat16 --remat
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU, run nothing
# Quiet libtpu's probes for TPU VM metadata on a machine that is not one.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-16")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")
# libtpu takes a process-wide lockfile; compile-only use from two processes (test workers,
# another compile check) is safe.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import flags  # noqa: E402

from prism_jax.cli import flag_checks as check  # noqa: E402
from prism_jax.cli import launcher

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a script, so importing this module (tests) adds no flags."""
  flags.DEFINE_list("topology", ["v5e:4x4"], "TPU topologies, e.g. v5e:4x4, v5p:2x2x1")
  flags.DEFINE_list("config", ["small"], "model preset names (prism_jax.config.MODEL_PRESETS)")
  flags.DEFINE_string("mesh", "1,-1,1", "data,fsdp,model sizes (one may be -1)")
  flags.DEFINE_integer("per_device_batch", 1, "rows per device (global = this x devices)")
  flags.DEFINE_integer("seq_len", 0, "sequence length (0: the preset's max_len)")
  flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "compute dtype")
  flags.DEFINE_bool("remat", False, "rematerialise each block in the backward pass")
  flags.DEFINE_enum("kind", "prism", ["prism", "dense"], "PRISM or the dense baseline")
  flags.DEFINE_enum("implementation", "default", ["default", "pallas_tpu", "xla"],
                    "prototype layer: the default (what a TPU run picks: resolved for the "
                    "platform compiled for, the Mosaic kernel), the kernel, or the XLA "
                    "reference")


GIB = 1024 ** 3
# HBM per jax device (one chip; v4/v5p chips are one megacore device).
HBM_BYTES = {"TPU v5 lite": 16 * GIB, "TPU v5e": 16 * GIB, "TPU v5": 95 * GIB,
             "TPU v5p": 95 * GIB, "TPU v4": 32 * GIB, "TPU v6 lite": 32 * GIB,
             "TPU v6e": 32 * GIB, "TPU v3": 16 * GIB, "TPU7x": 192 * GIB}


@dataclasses.dataclass
class Report:
  preset: str
  implementation: str
  topology: str
  device_kind: str
  mesh: tuple[int, int, int]
  global_batch: int
  seq_len: int
  params: int
  argument_bytes: int
  temp_bytes: int
  output_bytes: int
  alias_bytes: int
  code_bytes: int
  flops_per_device: float | None
  analytic_flops_per_device: float
  hbm_bytes: int | None
  compile_s: float
  kernel_calls: int  # Mosaic custom calls in the compiled step (the Pallas kernels)

  @property
  def peak_bytes(self) -> int:
    # donated state aliases its output: count it once
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

  @property
  def fits(self) -> bool | None:
    return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes


def topology_devices(name: str):
  """Compile-only devices of a TPU topology such as 'v5e:4x4' (libtpu, no TPU needed)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return topologies.get_topology_desc(name.replace(":", "="), platform="tpu").devices
  except Exception as e:  # libtpu missing or unknown topology: say which
    raise RuntimeError(f"cannot build TPU topology {name!r} ({type(e).__name__}: {e}); "
                       "install the tpu-aot extra: pip install libtpu==0.0.51") from e


def lower_train_step(preset_name: str, topology: str, mesh_sizes=(1, -1, 1),
                     per_device_batch: int = 1, seq_len: int = 0, dtype: str = "bfloat16",
                     remat: bool = False, kind: str = "prism", implementation: str | None = None,
                     n_layers: int = 0, grad_accum: int = 1):
  """The train step of a preset lowered for `topology`: (lowered, cfg, state, devices).

  `implementation` None is the model's default, resolved for the platform being compiled
  (the Mosaic kernel on TPU), as a TPU run gets it: no CPU path is lowered. `n_layers` > 0
  keeps the preset's widths with fewer blocks (a cheaper compile of the same layers).
  `grad_accum` N > 1: the step takes per_device_batch rows a chip as N microbatches
  (train.grad_accum, prism_jax/train/accumulate.py)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from prism_jax import sharding  # pylint: disable=import-outside-toplevel
  from prism_jax.config import MeshConfig, preset  # pylint: disable=import-outside-toplevel
  from prism_jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from prism_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  from prism_jax.train.optimizer import make_optimizer  # pylint: disable=import-outside-toplevel

  devices = topology_devices(topology)
  cfg = preset(preset_name)
  seq = seq_len or cfg.model.max_len
  model = dataclasses.replace(cfg.model, dtype=dtype, remat=remat, kind=kind,
                              implementation=implementation,
                              n_layers=n_layers or cfg.model.n_layers)
  mesh_cfg = MeshConfig(*mesh_sizes)
  batch = per_device_batch * len(devices)
  cfg = dataclasses.replace(cfg, model=model, mesh=mesh_cfg,
                            data=dataclasses.replace(cfg.data, seq_len=seq),
                            train=dataclasses.replace(cfg.train, batch_size=batch,
                                                      grad_accum=grad_accum))
  mesh = sharding.make_mesh(mesh_cfg, devices)
  tx = make_optimizer(cfg.train)
  state = state_lib.abstract_state(cfg, mesh, tx)
  graphdef, _ = state_lib.model_template(cfg.model)
  shardings = jax.tree.map(lambda a: a.sharding, state)
  step = step_lib.make_train_step(graphdef, cfg, tx, shardings, mesh)
  row = sharding.batch_sharding(mesh)
  batch_spec = {"inputs": jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=row),
                "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=row),
                "mask": jax.ShapeDtypeStruct((batch, seq), jnp.bool_, sharding=row)}
  with jax.set_mesh(mesh):
    lowered = step.lower(state, batch_spec)
  return lowered, cfg, state, devices


def read_compiled(compiled) -> dict[str, Any]:
  """What XLA says of a compiled program: its memory per device (the peak counts donated
  state, which aliases its output, once) and its cost (flops, bytes accessed; None where
  the backend gives none)."""
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  out = {"argument_bytes": int(mem.argument_size_in_bytes),
         "temp_bytes": int(mem.temp_size_in_bytes),
         "output_bytes": int(mem.output_size_in_bytes),
         "alias_bytes": int(mem.alias_size_in_bytes),
         "code_bytes": int(mem.generated_code_size_in_bytes),
         "flops": float(cost["flops"]) if "flops" in cost else None,
         "bytes_accessed": float(cost["bytes accessed"]) if "bytes accessed" in cost else None}
  out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                       - out["alias_bytes"])
  return out


def compile_train_step(preset_name: str, topology: str, mesh_sizes=(1, -1, 1),
                       per_device_batch: int = 1, seq_len: int = 0, dtype: str = "bfloat16",
                       remat: bool = False, kind: str = "prism",
                       implementation: str | None = None, n_layers: int = 0) -> Report:
  """AOT-compiles the train step of a preset for `topology`; returns its Report."""
  import jax  # pylint: disable=import-outside-toplevel
  from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
  from prism_jax import flops, sharding  # pylint: disable=import-outside-toplevel
  from prism_jax.config import MeshConfig  # pylint: disable=import-outside-toplevel

  start = time.perf_counter()
  lowered, cfg, state, devices = lower_train_step(
      preset_name, topology, mesh_sizes, per_device_batch, seq_len, dtype, remat, kind,
      implementation, n_layers)
  mesh_cfg, batch, seq = MeshConfig(*mesh_sizes), cfg.train.batch_size, cfg.data.seq_len
  implementation = api.resolve_implementation(implementation, "tpu")
  with jax.set_mesh(sharding.make_mesh(mesh_cfg, devices)):
    compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  read = read_compiled(compiled)
  n_params = sum(int(x.size) for x in jax.tree.leaves(state.params))
  kind_name = devices[0].device_kind
  analytic = flops.flops_per_token(cfg.model, seq)["train"] * batch * seq / len(devices)
  return Report(
      preset=preset_name, implementation=implementation, topology=topology, device_kind=kind_name,
      mesh=sharding.resolve_mesh_shape(mesh_cfg, len(devices)), global_batch=batch,
      seq_len=seq, params=n_params, argument_bytes=read["argument_bytes"],
      temp_bytes=read["temp_bytes"], output_bytes=read["output_bytes"],
      alias_bytes=read["alias_bytes"], code_bytes=read["code_bytes"],
      flops_per_device=read["flops"], analytic_flops_per_device=analytic,
      hbm_bytes=HBM_BYTES.get(kind_name), compile_s=compile_s,
      kernel_calls=compiled.as_text().count("tpu_custom_call"))


def format_table(reports: list[Report]) -> str:
  head = ("| preset | prototype layer | topology | mesh (d,f,m) | batch x seq | params | args GiB | temps GiB "
          "| out GiB | alias GiB | peak GiB | HBM GiB | fits | TFLOP/dev/step (XLA) "
          "| analytic | Mosaic calls | compile s |")
  lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
  for r in reports:
    xla = "n/a" if r.flops_per_device is None else f"{r.flops_per_device / 1e12:.2f}"
    hbm = "?" if r.hbm_bytes is None else f"{r.hbm_bytes / GIB:.0f}"
    fits = "?" if r.fits is None else ("yes" if r.fits else "NO")
    lines.append(
        f"| {r.preset} | {r.implementation} | {r.topology} ({r.device_kind}) | {r.mesh} | {r.global_batch} x "
        f"{r.seq_len} | {r.params / 1e6:.1f}M | {r.argument_bytes / GIB:.2f} | "
        f"{r.temp_bytes / GIB:.2f} | {r.output_bytes / GIB:.2f} | {r.alias_bytes / GIB:.2f} | "
        f"{r.peak_bytes / GIB:.2f} | {hbm} | {fits} | {xla} | "
        f"{r.analytic_flops_per_device / 1e12:.2f} | {r.kernel_calls} | {r.compile_s:.0f} |")
  return "\n".join(lines)


def check_flags() -> tuple[int, int, int]:
  """Every flag combination, before libtpu loads or anything compiles (one `error:`
  line); returns --mesh's sizes."""
  from prism_jax.config import preset_names, slice_name  # pylint: disable=import-outside-toplevel
  check.not_empty(topology=FLAGS.topology, config=FLAGS.config)
  for topology in FLAGS.topology:
    slice_name(topology)  # refuses a spelling other than <generation>:<AxB[xC]>
  check.known("config", FLAGS.config, preset_names())
  mesh_sizes = tuple(check.numbers("mesh", FLAGS.mesh.split(","), int, low=-1))
  if len(mesh_sizes) != 3 or 0 in mesh_sizes or mesh_sizes.count(-1) > 1:
    raise ValueError(f"--mesh needs data,fsdp,model (positive, at most one -1); got "
                     f"{FLAGS.mesh!r}")
  check.at_least(1, per_device_batch=FLAGS.per_device_batch)
  check.at_least(0, seq_len=FLAGS.seq_len)
  return mesh_sizes


def main(argv: list[str]) -> None:
  del argv
  mesh_sizes = check_flags()
  reports: list[Any] = []
  for topology in FLAGS.topology:
    for name in FLAGS.config:
      impl = None if FLAGS.implementation == "default" else FLAGS.implementation
      reports.append(compile_train_step(name, topology, mesh_sizes, FLAGS.per_device_batch,
                                        FLAGS.seq_len, FLAGS.dtype, FLAGS.remat, FLAGS.kind,
                                        impl))
      print(format_table(reports[-1:]).splitlines()[-1], flush=True)
  print()
  print(format_table(reports))


if __name__ == "__main__":
  define_flags()
  launcher.run(main)
