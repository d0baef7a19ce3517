"""AOT compile of the `small` train step for a TPU topology from this CPU box (libtpu).

Runs only with the tpu-aot extra installed (`pip install libtpu==0.0.51`); select or
deselect it with `-m tpu_aot` / `-m "not tpu_aot"`.
"""

import importlib.util

import pytest

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="needs the tpu-aot extra (pip install libtpu==0.0.51)"),
]


@pytest.mark.long
def test_small_compiles_for_v5e_4x4_and_fits():
  """`small`'s widths and bank with 1 of its 12 blocks and 256 of its 1024 positions: the
  same layers, at a fraction of the compile time (`python -m benchmarks.compile_check
  --config=small` compiles the whole step; the scale table, every preset at its shape)."""
  from benchmarks import compile_check  # pylint: disable=import-outside-toplevel
  from prism_jax.config import model_preset  # pylint: disable=import-outside-toplevel
  report = compile_check.compile_train_step("small", "v5e:4x4", (1, -1, 1), seq_len=256,
                                            n_layers=1)
  assert report.mesh == (1, 16, 1) and report.device_kind.startswith("TPU v5")
  cfg = model_preset("small")
  expected = (cfg.vocab_size + cfg.max_len + cfg.num_prototypes) * cfg.d_model
  assert expected < report.params < expected + 2 * 12 * cfg.d_model ** 2  # + 1 block
  # FSDP over 16 chips: params + Adam moments (3 x 4 bytes each) split 16 ways, plus
  # replicated norms/biases and TPU layout padding
  sharded_state = 3 * 4 * report.params / 16
  assert 0.9 * sharded_state < report.argument_bytes < 1.5 * sharded_state
  assert report.temp_bytes > 0 and report.flops_per_device > 0
  assert report.fits
  assert report.implementation == "pallas_tpu" and report.kernel_calls > 0  # the kernel
  print("\n" + compile_check.format_table([report]))


def _platform_paths(text: str) -> dict:
  """What a lowered program holds of the CPU speed paths: barriers, and ops traced in
  their name scope (cpu.SCOPE, in every op location)."""
  from pallas_kernels.topk_reconstruct import cpu  # pylint: disable=import-outside-toplevel
  return {"optimization_barrier": text.count("optimization_barrier"),
          cpu.SCOPE: text.count(f"/{cpu.SCOPE}/")}


@pytest.mark.long  # make test-long (issue 56 item 7): a TPU compile
def test_small_step_lowered_for_tpu_has_no_cpu_path():
  """The default implementation and the model's CPU speed paths are chosen for the
  platform being compiled: the `small` step lowered for a TPU holds no barrier and no op
  of a CPU-only path (97 barriers when they were chosen by the default backend), and its
  prototype layer is the Mosaic kernel. The same step lowered for CPU (the tiny shape)
  holds them, so the check can fail."""
  from benchmarks import compile_check  # pylint: disable=import-outside-toplevel
  lowered, cfg, _, _ = compile_check.lower_train_step("small", "v5e:2x2", (1, -1, 1),
                                                      seq_len=128)
  assert cfg.model.implementation is None
  tpu = lowered.as_text(debug_info=True)
  assert _platform_paths(tpu) == dict.fromkeys(_platform_paths(""), 0)
  assert "tpu_custom_call" in tpu
  cpu = _cpu_lowered_tiny_step().as_text(debug_info=True)
  counts = _platform_paths(cpu)
  assert all(counts.values()), counts
  assert "tpu_custom_call" not in cpu


def _cpu_lowered_tiny_step():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from prism_jax.config import preset  # pylint: disable=import-outside-toplevel
  from prism_jax.sharding import batch_sharding, make_mesh  # pylint: disable=import-outside-toplevel
  from prism_jax.train import abstract_state, make_optimizer  # pylint: disable=import-outside-toplevel
  from prism_jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  from prism_jax.train.step import make_train_step  # pylint: disable=import-outside-toplevel
  cfg = preset("tiny")
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  tx = make_optimizer(cfg.train)
  state = abstract_state(cfg, mesh, tx)
  graphdef, _ = state_lib.model_template(cfg.model)
  step = make_train_step(graphdef, cfg, tx, jax.tree.map(lambda a: a.sharding, state), mesh)
  shape, row = (cfg.train.batch_size, cfg.data.seq_len), batch_sharding(mesh)
  batch = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=row),
           "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=row),
           "mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=row)}
  with jax.set_mesh(mesh):
    return step.lower(state, batch)


@pytest.mark.long
def test_llama_1b_compiles_for_tpu_with_no_cpu_path():
  """The Llama-family recipe's train step (2 of its 16 blocks, its real widths: 32 query /
  8 key-value heads, SwiGLU 8192, the 128,256-id vocabulary) lowered and compiled for a
  v5p slice with FSDP and the K-sharded bank: no barrier, no CPU-only op, the bank on the
  Mosaic kernel."""
  from benchmarks import compile_check  # pylint: disable=import-outside-toplevel
  lowered, cfg, _, _ = compile_check.lower_train_step("llama_1b", "v5p:2x2x1", (1, 2, 2),
                                                      seq_len=256, n_layers=2)
  assert cfg.model.arch == "llama" and cfg.model.kv_heads == 8
  tpu = lowered.as_text(debug_info=True)
  assert _platform_paths(tpu) == dict.fromkeys(_platform_paths(""), 0)
  assert "tpu_custom_call" in tpu
  assert lowered.compile() is not None
