"""One recipe (prism_jax/train/recipe.py): `train()` and the LDS retrains run the same
phases, bank init and revival, and a retrain's steps compile once per config."""

import dataclasses

import numpy as np

from prism_jax.config import preset
from prism_jax.data import prepare_data
from prism_jax.evaluation import retrain as retrain_lib
from prism_jax.train import Recipe, apply_overrides, train

WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "return", "def"]


def _cfg(tmp_path):
  rng = np.random.default_rng(3)
  (tmp_path / "c.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 12))
                                              for _ in range(60)))
  return apply_overrides(preset("tiny"), [
      "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
      "model.k=2", "model.vocab_size=258", "model.max_len=16", "data.tokenizer=byte",
      "data.seq_len=16", "data.val_fraction=0.1", "train.batch_size=8", "train.steps=8",
      "train.warmup_steps=1", "train.proto_init_step=2", "train.revive_every=3",
      "train.eval_every=8", "train.eval_batches=1", "train.ckpt_every=8",
      f"data.sources={tmp_path / 'c.txt'}"])


def test_train_and_retrain_run_the_same_recipe_steps(tmp_path, monkeypatch):
  cfg = _cfg(tmp_path)
  calls = []
  real_before, real_step_for = Recipe.before_step, Recipe.step_for

  def before_step(self, step, state, source):
    state, note = real_before(self, step, state, source)
    calls.append((step, note.split(":")[1].split()[0] if note else ""))
    return state, note

  def step_for(self, step):
    fn = real_step_for(self, step)
    phases.add((step < cfg.train.proto_init_step, fn))
    return fn

  monkeypatch.setattr(Recipe, "before_step", before_step)
  monkeypatch.setattr(Recipe, "step_for", step_for)
  phases = set()
  train(cfg, str(tmp_path / "run"))
  by_train, train_phases = list(calls), {dense for dense, _ in phases}
  calls.clear()
  phases = set()
  packed = prepare_data(cfg.data, cfg.model.vocab_size, str(tmp_path / "run"))
  retrain_lib.retrain(cfg, packed, np.arange(packed.num_rows("train")), cfg.train.seed)
  # the same hooks at the same steps (what revival finds depends on each one's rows)
  assert [s for s, _ in calls] == [s for s, _ in by_train] == [2, 3, 6]
  assert by_train[0][1] == calls[0][1] == "prototypes"  # the bank is set at step 2
  assert {dense for dense, _ in phases} == train_phases == {True, False}  # warm-up, PRISM
  retrain_lib.retrain(cfg, packed, np.arange(packed.num_rows("train")), cfg.train.seed + 1)
  seeded = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                seed=cfg.train.seed + 1))
  recipe, _ = retrain_lib._recipe(seeded)  # pylint: disable=protected-access
  assert len(recipe._steps) == 2  # pylint: disable=protected-access  # one program per phase
