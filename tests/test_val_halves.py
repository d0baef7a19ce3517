"""The val split's choose / test halves (prism_jax/data/val_halves.py) and the guarantee
that choices never read the test half: the sweep's measurement (the code whose numbers
settings are chosen by) is run on a trained tiny model with the loader recorded."""

import numpy as np
import pytest

from prism_jax import data as data_lib
from prism_jax.config import preset
from prism_jax.data import val_halves as vh
from prism_jax.train import apply_overrides, train

WORDS = ["alpha", "beta", "gamma", "delta", "the", "of", "mesh", "token"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("halves")
  rng = np.random.default_rng(9)
  (root / "c.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 10)) for _ in range(120)))
  cfg = apply_overrides(preset("tiny"), [
      "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
      "model.k=4", "model.vocab_size=258", "model.max_len=32", "data.tokenizer=byte",
      "data.seq_len=32", "data.val_fraction=0.2", "data.txt_documents=60",
      "train.batch_size=8", "train.steps=3", "train.warmup_steps=1",
      "train.proto_init_step=0", "train.eval_every=3", "train.eval_batches=1",
      f"data.sources={root / 'c.txt'}"])
  train(cfg, str(root / "run"))
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, str(root / "run"))
  return str(root / "run"), cfg, packed


def test_halves_split_the_val_documents_seeded(run):
  _, cfg, packed = run
  val = set(np.asarray(packed.document_ids("val")).tolist())
  h = vh.val_halves(packed, seed=0)
  choose, test = set(h["choose"].tolist()), set(h["test"].tolist())
  assert choose and test and not choose & test and choose | test == val
  assert abs(len(choose) - len(test)) <= 1
  again = vh.val_halves(packed, seed=0)
  assert (again["choose"] == h["choose"]).all()
  other = vh.val_halves(packed, seed=1)
  assert set(other["choose"].tolist()) != choose or len(val) < 4
  # the loader scores exactly its half's target tokens
  loader = data_lib.make_loader(packed, "val", 8, 0)
  half = vh.HalfLoader(loader, h["choose"])
  for i in range(loader.num_batches):
    full, part = loader.batch_at(i), half.batch_at(i)
    want = np.asarray(full["mask"]) & np.isin(full["example_id"], h["choose"])
    np.testing.assert_array_equal(part["mask"], want)
  assert half.seen_documents <= choose


def test_the_choice_measurement_never_reads_the_test_half(run, monkeypatch):
  from experiments import prototype_measure  # pylint: disable=import-outside-toplevel
  workdir, _, packed = run
  made = []

  class Recording(vh.HalfLoader):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  monkeypatch.setattr(vh, "HalfLoader", Recording)
  row = prototype_measure.measure_half(workdir, "choose", 0)
  halves = vh.val_halves(packed, seed=0)
  seen = set().union(*(r.seen_documents for r in made))
  assert made and seen, "the measurement read no val token"
  assert not seen & set(halves["test"].tolist()), "a choose-half measurement read the test half"
  assert seen <= set(halves["choose"].tolist())
  assert row["documents"] == len(halves["choose"]) and 0 <= row["agreement"] <= 1


@pytest.mark.parametrize("argv,fragment", [
    (["experiments.bank_capacity", "--root=/tmp/x", "--backbones=12x4"],
     "d_model must be a positive multiple of 32"),
    (["experiments.bank_capacity", "--root=/tmp/x", "--grid=64"], "write K:k"),
    (["experiments.bank_capacity", "--root=/tmp/x", "--grid=8:16"], "need 0 < k <= K"),
    (["experiments.size_trend", "--root=/tmp/x", "--setting=2048:4:train.lr=1"],
     "model.*/loss.* overrides"),
    (["experiments.default_choice", "--root=/tmp/x", "--steps=40"], "give > 50"),
    (["experiments.bank_alive", "--root=/tmp/x", "--runs=scratch"], "unknown ['scratch']")])
def test_the_experiments_refuse_bad_flags_in_one_line_before_any_work(argv, fragment):
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-m", *argv], cwd=repo, capture_output=True, text=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert r.returncode == 2 and len(errors) == 1 and fragment in errors[0], r.stderr[-2000:]
  assert not os.path.exists("/tmp/x/128x4")  # nothing trained

