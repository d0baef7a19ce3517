"""Golden one-step test: one train_step's metrics on a fixed tiny config, seed and batch.

The numbers live in tests/golden/one_step.json. Regenerate them with
    UPDATE_GOLDEN=1 JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/test_train_golden.py
ONLY when a change is MEANT to alter the numerics of training (model init or forward,
losses, optimiser, schedule, the step itself), and say so in the commit message. A diff
after a refactor that should not change the maths is a bug, not a reason to regenerate.

History: regenerated for issue 11, whose new tiny-preset default adds the auxiliary
prototype-path cross-entropy λ_proto · CE(W z_hat) with λ_proto = 1 (docs/RESULTS.md
"Faithfulness"): the loss, the gradients and so every parameter after the step change, and
the step reports the new `proto_ce` metric. The other metrics' maths is unchanged (with
loss.lambda_proto=0 the previous numbers are reproduced).

Regenerated again for issue 11's second round: the tiny preset's λ_proto = 1 is replaced by
λ_proto_kl = 1, KL(sg(softmax W z) ‖ softmax W z_hat) (as faithful at a lower full CE on
both sweep configs, docs/RESULTS.md "Faithfulness"): the loss and so every parameter after
the step change, and the step reports `proto_kl` instead of `proto_ce`. With
loss.lambda_proto_kl=0 and loss.lambda_proto=1 the previous numbers are reproduced.
"""

import json
import os

import jax
import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.sharding import make_mesh
from prism_jax.train import apply_overrides, create_train_state, make_optimizer
from prism_jax.train.step import make_train_step

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "one_step.json")
SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=4", "model.vocab_size=64", "model.max_len=16", "model.proto_init=normal",
    "data.seq_len=16", "train.batch_size=8", "train.warmup_steps=0", "train.steps=10",
    "train.seed=3",
]
RTOL, ATOL = 1e-4, 1e-6  # loose enough for another CPU's float rounding, far below any
#                          change of the maths (a changed weight moves these by >1e-2)


def _batch(cfg):
  rng = np.random.default_rng(1234)
  shape = (cfg.train.batch_size, cfg.data.seq_len)
  tokens = rng.integers(0, cfg.model.vocab_size, size=(shape[0], shape[1] + 1))
  mask = rng.random(shape) > 0.15
  return {"inputs": tokens[:, :-1].astype(np.int32),
          "targets": tokens[:, 1:].astype(np.int32), "mask": mask}


def one_step(devices):
  cfg = apply_overrides(preset("tiny"), SETS)
  mesh = make_mesh(cfg.mesh, devices)
  tx = make_optimizer(cfg.train)
  with jax.set_mesh(mesh):
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    step = make_train_step(graphdef, cfg, tx, shardings, mesh)
    state, metrics = step(state, _batch(cfg))
  out = {k: float(v) for k, v in jax.device_get(metrics).items()}
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]
  out["param_sum"] = float(sum(x.sum() for x in leaves))
  out["param_sq_sum"] = float(sum((x * x).sum() for x in leaves))
  out["protos_sq_sum"] = float((np.asarray(state.params["bank"]["protos"], np.float64) ** 2
                                ).sum())
  out["step"] = int(state.step)
  return out


@pytest.mark.parametrize("num_devices", [1, 8])
def test_one_step_matches_golden(num_devices):
  got = one_step(jax.devices()[:num_devices])
  if os.environ.get("UPDATE_GOLDEN") and num_devices == 1:
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
      json.dump({"_note": "written by tests/test_train_golden.py with UPDATE_GOLDEN=1 on "
                          "1 CPU device; see that file's docstring for when to update",
                 "sets": SETS, "metrics": got}, f, indent=1, sort_keys=True)
  with open(GOLDEN) as f:
    golden = json.load(f)
  assert golden["sets"] == SETS, "the golden file was produced with other settings"
  want = golden["metrics"]
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)
