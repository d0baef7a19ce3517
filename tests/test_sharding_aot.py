"""AOT compile of the `small` train step for a TPU topology from this CPU box (libtpu).

Runs only with the tpu-aot extra installed (`pip install libtpu==0.0.51`); it costs about
2 CPU-minutes, so select or deselect it with `-m tpu_aot` / `-m "not tpu_aot"`.
"""

import importlib.util

import pytest

pytestmark = [
    pytest.mark.tpu_aot,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="needs the tpu-aot extra (pip install libtpu==0.0.51)"),
]


def test_small_compiles_for_v5e_4x4_and_fits():
  from benchmarks import compile_check  # pylint: disable=import-outside-toplevel
  from prism_jax.config import model_preset  # pylint: disable=import-outside-toplevel
  report = compile_check.compile_train_step("small", "v5e:4x4", (1, -1, 1))
  assert report.mesh == (1, 16, 1) and report.device_kind.startswith("TPU v5")
  cfg = model_preset("small")
  expected = (cfg.vocab_size + cfg.max_len + cfg.num_prototypes) * cfg.d_model
  assert report.params > expected  # embeddings + bank, plus the blocks
  # FSDP over 16 chips: params + Adam moments (3 x 4 bytes each) split 16 ways, plus
  # replicated norms/biases and TPU layout padding
  sharded_state = 3 * 4 * report.params / 16
  assert 0.9 * sharded_state < report.argument_bytes < 1.5 * sharded_state
  assert report.temp_bytes > 0 and report.flops_per_device > 0
  assert report.fits
  assert report.implementation == "pallas_tpu" and report.kernel_calls > 0  # the kernel
  print("\n" + compile_check.format_table([report]))
