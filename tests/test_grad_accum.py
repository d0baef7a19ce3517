"""Gradient accumulation (prism_jax/train/accumulate.py): training with train.grad_accum=4
at batch B equals training at batch B without it, on one device and on the 8-device mesh,
with the bank set from data and R1/R2 (R1's nearest token taken over the whole batch),
the dense warm-up and residual dropout inside the accumulated steps.

The reference is the same code at grad_accum=1: float32 sums in another order, so equal to
rounding (relative 1e-5 on losses, and on each parameter tensor's norm after 5 steps), not
bit for bit.
"""

import jax
import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.train import apply_overrides, train
from prism_jax.train.accumulate import split
from prism_jax.train.metrics import read_metrics
from prism_jax.train.state import default_mesh


def _run(tmp_path, name, accum, devices, batch):
  cfg = apply_overrides(preset("tiny"), [
      "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
      "model.k=4", "model.vocab_size=258", "model.max_len=16", "model.residual_dropout=0.2",
      "data.tokenizer=byte", "data.seq_len=16", f"train.batch_size={batch}",
      "train.steps=5", "train.warmup_steps=1", "train.proto_init_step=2",
      "train.eval_every=5", "train.eval_batches=1", "train.log_every=1",
      f"train.grad_accum={accum}", "loss.lambda_proto_kl=1.0",
      f"data.packed_dir={tmp_path / 'data'}"])
  mesh = default_mesh(cfg, jax.devices()[:devices])
  result = train(cfg, str(tmp_path / name), mesh=mesh)
  losses = {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / name), "train")}
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(result.state.params))
  return losses, {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


@pytest.mark.long  # make test-long (issue 56 item 7): several training runs, 8 devices
@pytest.mark.parametrize("devices,batch", [(1, 8), (8, 32)])
def test_accumulated_training_equals_the_whole_batch(tmp_path, devices, batch):
  if len(jax.devices()) < devices:
    pytest.skip(f"needs {devices} devices")
  whole, p_whole = _run(tmp_path, "whole", 1, devices, batch)
  accum, p_accum = _run(tmp_path, "accum", 4, devices, batch)
  assert sorted(whole) == sorted(accum) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([accum[s] for s in range(1, 6)], [whole[s] for s in range(1, 6)],
                             rtol=1e-5)
  # per parameter tensor, relative to its norm: Adam scales each element's update by
  # 1/sqrt(v), so an element whose gradient is rounding noise (a 1e-9 gradient) may move by
  # ~lr either way; elementwise tolerances would test the noise
  # The key bias is left out: a constant added to every key shifts a query's scores alike,
  # which softmax ignores, so its gradient is exactly zero and what float32 computes is
  # rounding noise, which Adam scales up to ~lr per step in either run.
  assert p_accum.keys() == p_whole.keys()
  for name, b in p_whole.items():
    a = p_accum[name]
    if name.endswith("['qkv_bias']"):
      a, b = a[[0, 2]], b[[0, 2]]
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), (name, np.abs(a - b).max())


def test_split_is_strided_and_refuses_a_ragged_batch():
  rows = np.arange(12).reshape(12, 1)
  got = np.asarray(split({"x": rows}, 4)["x"])[..., 0]
  np.testing.assert_array_equal(got, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]])
  with pytest.raises(ValueError, match="does not split into 5"):
    split({"x": rows}, 5)
