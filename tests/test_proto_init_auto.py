"""train.proto_init_step="auto" (issue 53 item 2): the bank is set at the first eval step
where the hidden states' mean cosine to their mean direction is below train.proto_init_cos,
or at train.proto_init_latest whatever it is; the step is kept in the checkpoint, so a resume
does not set the bank again.

The reference statistic is recomputed here from each saved checkpoint in float64 NumPy (the
init's own tokens through the restored backbone), independently of the recipe's decision.
"""

import os
import shutil

import numpy as np
import pytest

from prism_jax.config import preset
from prism_jax.data import make_loader, prepare_data
from prism_jax.loading import load_for_inference
from prism_jax.train import Checkpointer, ConfigMismatchError, apply_overrides, train
from prism_jax.train import revive
from prism_jax.train.recipe import BANK_SET_AT, proto_init_tokens
from test_checkpoint_bad_inputs import SETS, _corpus

# `make test-long` (five short training runs: ~1.5 min); .ci/run runs it after `make test`.
pytestmark = pytest.mark.long

EVAL = 5
LATEST = 15


def _cfg(data, cos, steps=20, latest=LATEST, revive=0, every=EVAL):
  sets = [s for s in SETS if not s.startswith(("train.proto_init_step", "train.steps",
                                                "train.eval_every", "train.ckpt_every",
                                                "data.val_fraction"))]
  return apply_overrides(preset("tiny"), sets + [
      f"data.sources={data}", "data.val_fraction=0.1", f"train.steps={steps}",
      "train.proto_init_step=auto", f"train.proto_init_cos={cos}",
      f"train.proto_init_latest={latest}", f"train.eval_every={every}",
      f"train.revive_every={revive}",
      f"train.ckpt_every={EVAL}", "train.keep_checkpoints=10", "train.log_to="])


def _bank_set_at(workdir, step):
  ck = Checkpointer(workdir, read_only=True)
  try:
    return ck.read_data_state(step).get(BANK_SET_AT)
  finally:
    ck.close()


def _statistic(workdir, cfg, step):
  """float64 mean cosine to the mean direction of the init tokens' states at `step`."""
  model, cfg_run, _ = load_for_inference(workdir, step=step)
  packed = prepare_data(cfg_run.data, cfg_run.model.vocab_size, workdir)
  loader = make_loader(packed, "train", cfg.train.batch_size, cfg.data.seed)
  toks, mask = proto_init_tokens(loader, cfg, step)
  z = np.asarray(model.backbone(toks)[0], np.float64).reshape(-1, cfg.model.d_model)
  z = z[np.asarray(mask, bool).reshape(-1)]
  unit = z / np.linalg.norm(z, axis=1, keepdims=True)
  mean = unit.mean(0)
  return float((unit @ (mean / np.linalg.norm(mean))).mean())


@pytest.fixture(scope="module")
def never(tmp_path_factory):
  """A run whose threshold is never crossed: the latest step sets the bank."""
  root = tmp_path_factory.mktemp("auto")
  data = _corpus(root / "corpus.txt")
  cfg = _cfg(data, 1e-6)
  train(cfg, str(root / "never"))
  return root, data, cfg


def test_latest_step_forces_the_init(never):
  root, _, cfg = never
  run = str(root / "never")
  assert _bank_set_at(run, 20) == LATEST
  assert _bank_set_at(run, 10) is None  # not yet set at the earlier checkpoints
  assert all(_statistic(run, cfg, s) > 1e-6 for s in (EVAL, 2 * EVAL))


def test_init_when_the_statistic_crosses(never):
  root, data, cfg = never
  # the dense phase is the same in every auto run until its init: the statistic at the eval
  # steps before LATEST, from the first run's checkpoints, is the second run's too
  stats = {s: _statistic(str(root / "never"), cfg, s) for s in (EVAL, 2 * EVAL)}
  threshold = float(np.mean(list(stats.values())))
  expect = next((s for s in sorted(stats) if stats[s] < threshold), LATEST)
  assert stats[EVAL] != stats[2 * EVAL]
  run = str(root / "crosses")
  revived = []
  real = revive.revive_dead
  def counting(graphdef, state, *args, **kw):
    revived.append(int(state.step))
    return real(graphdef, state, *args, **kw)
  revive.revive_dead = counting
  try:
    train(_cfg(data, threshold, revive=EVAL), run)
    assert _bank_set_at(run, 20) == expect
    # a resume keeps the step: a longer run does not set the bank again
    train(_cfg(data, threshold, steps=25, revive=EVAL), run)
  finally:
    revive.revive_dead = real
  assert _bank_set_at(run, 25) == expect
  # revival runs every revive_every steps once the bank is set, not before
  assert revived == list(range(expect + EVAL, 25, EVAL))


def test_a_resume_before_the_init_keeps_the_schedule(never, tmp_path):
  """The step "auto" chooses depends on train.eval_every and the latest step: a resume that
  changed them before the bank was set would set it elsewhere than an uninterrupted run."""
  _, data, _ = never
  run = str(tmp_path / "early")
  train(_cfg(data, 1e-6, steps=10, latest=8), run)
  assert _bank_set_at(run, 10) == 8 and _bank_set_at(run, 5) is None
  shutil.rmtree(os.path.join(run, "checkpoints", "10"))  # as if stopped after step 5
  with pytest.raises(ConfigMismatchError, match="has not set its bank yet"):
    train(_cfg(data, 1e-6, steps=10, latest=8, every=4), run)  # checks at 8, not 5
  train(_cfg(data, 1e-6, steps=10, latest=8), run)  # the same schedule resumes
  assert _bank_set_at(run, 10) == 8
