"""LDS maths against scipy / direct NumPy, the sign convention, retrains on subsets, the
gradient-dot baseline against per-example autodiff, and a micro LDS run end to end."""

import json
import os
import secrets
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from prism_jax import losses
from prism_jax.attribution.scoring import grad_dot
from prism_jax.attribution.quality import lds, methods, retrain
from prism_jax.train import apply_overrides

from micro_lds import ROWS, micro_setting
from results_md import lds_removal


def _reference_lds(scores_QxE, keep_MxE, measured_QxM):
  """Direct: predicted loss = −(sum of the kept sequences' scores), Spearman by scipy."""
  out = []
  for q in range(scores_QxE.shape[0]):
    pred = [-sum(scores_QxE[q, e] for e in np.flatnonzero(keep_MxE[m]))
            for m in range(keep_MxE.shape[0])]
    out.append(stats.spearmanr(pred, measured_QxM[q]).statistic)
  return np.asarray(out)


def test_spearman_matches_scipy_with_ties():
  rng = np.random.default_rng(1)
  a = np.round(rng.normal(size=(6, 11)), 1)  # rounding makes ties
  b = np.round(rng.normal(size=(6, 11)), 1)
  want = [stats.spearmanr(a[q], b[q]).statistic for q in range(6)]
  np.testing.assert_allclose(lds.spearman_rows(a, b), want, rtol=1e-12, atol=1e-12)


def test_lds_matches_direct_numpy():
  rng = np.random.default_rng(2)
  scores = rng.normal(size=(5, 40))
  keep = lds.subset_masks(40, 9, 0.5, seed=3)
  measured = rng.normal(size=(5, 9))
  np.testing.assert_allclose(lds.lds_per_query(scores, keep, measured),
                             _reference_lds(scores, keep, measured), rtol=1e-12)


def test_sign_convention_helpful_scores_give_positive_lds():
  rng = np.random.default_rng(4)
  s = rng.normal(size=(3, 60))  # s > 0: the sequence lowers the query loss when kept
  keep = lds.subset_masks(60, 12, 0.5, seed=5)
  measured = 7.0 - (keep.astype(float) @ s.T).T + 1e-3 * rng.normal(size=(3, 12))
  assert np.all(lds.lds_per_query(s, keep, measured) > 0.95)
  assert np.all(lds.lds_per_query(-s, keep, measured) < -0.95)


def test_subset_masks_and_removal():
  keep = lds.subset_masks(101, 7, 0.3, seed=0)
  assert keep.shape == (7, 101) and np.all(keep.sum(1) == 30)
  np.testing.assert_array_equal(keep, lds.subset_masks(101, 7, 0.3, seed=0))
  assert not np.array_equal(keep, lds.subset_masks(101, 7, 0.3, seed=1))
  s = np.random.default_rng(6).normal(size=50)
  k = lds.removal_keep(s, 8)
  assert set(np.flatnonzero(~k)) == set(sorted(range(50), key=lambda e: -s[e])[:8])
  assert lds.removal_keep(s, 0).all()


def test_bootstrap_ci():
  v = np.random.default_rng(7).normal(0.3, 0.1, size=64)
  mean, lo, hi = lds.bootstrap_ci(np.r_[v, np.nan])
  assert mean == pytest.approx(v.mean()) and lo < mean < hi
  assert hi - lo == pytest.approx(2 * 1.96 * v.std() / 8, rel=0.25)  # ≈ the normal CI
  assert lds.bootstrap_ci(np.full(5, 0.25)) == pytest.approx((0.25, 0.25, 0.25))


def test_query_halves_partition_and_the_choice_is_made_on_the_choose_half_only():
  choose, report = lds.query_halves(9, seed=3)
  assert len(choose) == 4 and len(report) == 5
  assert sorted(np.r_[choose, report].tolist()) == list(range(9))
  assert np.array_equal(choose, lds.query_halves(9, seed=3)[0])  # seeded
  assert not np.array_equal(choose, lds.query_halves(9, seed=4)[0])
  rng = np.random.default_rng(11)
  per_q = {m: rng.normal(size=9) for m in ("a", "b", "c")}
  per_q["b"][choose] += 5.0  # best where it is chosen ...
  per_q["c"][report] += 9.0  # ... whatever the report half says
  best, means = lds.choose_best(per_q, ["a", "b", "c"], choose)
  assert best == "b" and means["b"] == pytest.approx(per_q["b"][choose].mean())
  tie = {"x": np.ones(9), "y": np.ones(9)}
  assert lds.choose_best(tie, ["y", "x"], choose)[0] == "y"  # ties: the first listed


@pytest.mark.parametrize("call, match", [
    (lambda: lds.query_halves(1, 0), ">= 2 queries"),
    (lambda: lds.choose_best({"a": np.ones(3)}, ["a", "b"], np.arange(2)), "no LDS for"),
    (lambda: lds.subset_masks(10, 3, 1.0, 0), "alpha"),
    (lambda: lds.spearman_rows(np.ones((2, 2)), np.ones((2, 2))), ">= 3 subsets"),
    (lambda: lds.spearman_rows(np.ones((2, 4)), np.ones((2, 5))), "one shape"),
    (lambda: lds.predicted_loss(np.ones((2, 4)), np.ones((3, 5), bool)), "disagree"),
    (lambda: lds.lds_per_query(np.ones((2, 4)), np.ones((3, 4), bool), np.ones((2, 4))),
     "measured"),
    (lambda: lds.bootstrap_ci(np.full(3, np.nan)), "no finite"),
    (lambda: lds.removal_keep(np.ones(4), 4), "cannot remove"),
    (lambda: methods.scores("tracin", None, None, None, None, 4, ""), "unknown attribution"),
    (lambda: retrain.Queries(np.ones((2, 5), np.int32), np.ones((2, 5), bool)), "(Q, L-1)"),
])
def test_bad_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
  return micro_setting(str(tmp_path_factory.mktemp("lds")))


def test_subset_batches_draw_only_kept_rows(micro):
  cfg, packed, _, _ = micro
  kept = np.arange(3, ROWS, 3)
  src = retrain.SubsetBatches(packed, kept, 4, seed=0)
  seen = np.concatenate([src.global_batch_at(s)["row_id"] for s in range(6)])
  assert set(seen) <= set(kept) and len(set(seen)) == len(kept)  # 6 batches = 2 epochs
  np.testing.assert_array_equal(retrain.SubsetBatches(packed, kept, 4, 0).global_batch_at(5)[
      "inputs"], src.global_batch_at(5)["inputs"])
  other = [retrain.SubsetBatches(packed, kept, 4, 1).global_batch_at(s)["row_id"]
           for s in range(3)]
  assert not all(np.array_equal(o, src.global_batch_at(s)["row_id"])
                 for s, o in enumerate(other))
  with pytest.raises(ValueError, match="cannot fill"):
    retrain.SubsetBatches(packed, kept[:2], 4, 0)
  with pytest.raises(ValueError, match="must be in"):
    retrain.SubsetBatches(packed, [0, 1, 2, 10 ** 7], 2, 0)
  with pytest.raises(ValueError, match="at least one target"):
    retrain.Queries(np.ones((2, 5), np.int32), np.zeros((2, 4), bool))


def test_measure_is_the_summed_target_nll(micro):
  _, _, queries, model = micro
  b = queries.batch()
  forward = nnx.jit(lambda m, x, k: m(x, mask_BxT=k).logits_BxTxV)
  logits = np.asarray(forward(model, jnp.asarray(b["inputs"]), jnp.asarray(b["mask"])),
                      np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - logits.max(-1, keepdims=True)
  want = [-sum(logp[q, t, b["targets"][q, t]] for t in np.flatnonzero(b["mask"][q]))
          for q in range(3)]
  np.testing.assert_allclose(retrain.measure(model, queries), want, rtol=1e-5)


@pytest.fixture(scope="module")
def gd(micro):
  """grad_dot scores of the 3 queries plus a 4th query that IS training row 7."""
  _, packed, queries, model = micro
  from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top
  _, row7 = next(cache_format.iter_rows(packed, "train", 1, 7, 8))
  qb = {k: np.concatenate([queries.batch()[k], row7[k]]) for k in ("inputs", "targets", "mask")}
  ids, sc = grad_dot.grad_dot_scores(model, qb, packed, max_rows=ROWS, batch_rows=8)
  return qb, ids, sc


def test_grad_dot_matches_per_example_autodiff_and_sign(micro, gd):
  _, packed, _, model = micro
  qb, ids, sc = gd
  np.testing.assert_array_equal(ids, np.arange(ROWS))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def flat_grad(inputs_T, targets_T, mask_T):  # one row at a time, no vmap
    def loss(p):
      out = nnx.merge(graphdef, p, rest)(inputs_T[None], mask_BxT=mask_T[None])
      return jnp.sum(losses.token_nll(out.logits_BxTxV[0], targets_T) * mask_T)
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(jax.grad(loss)(params))])

  grads = lambda b, n: np.stack([np.asarray(flat_grad(b["inputs"][i], b["targets"][i],
                                                      b["mask"][i]), np.float64)
                                 for i in range(n)])
  from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top
  _, tb = next(cache_format.iter_rows(packed, "train", 5, 0, 5))
  want = grads(qb, 3) @ grads(tb, 5).T
  np.testing.assert_allclose(sc[:3, :5], want, rtol=2e-3, atol=1e-3 * np.abs(want).max())
  # Sign: the query that IS training row 7 is helped most by row 7 itself (|g|² > 0).
  assert sc[3, 7] > 0 and np.argmax(sc[3]) == 7


def test_micro_lds_end_to_end(micro, gd, tmp_path):
  """A few subsets of the micro model retrained: the library's LDS equals the direct
  NumPy/scipy computation on the same measurements; a rerun retrains nothing."""
  cfg, packed, queries, _ = micro
  scores = gd[2][:3]
  keep = lds.subset_masks(ROWS, 4, 0.5, seed=0)
  key = retrain.content_key(np.asarray(packed.rows("train")["tokens"][:ROWS]), queries, cfg,
                            "c0", {"alpha": 0.5})
  store = retrain.RetrainStore(str(tmp_path), key)
  meas = np.stack([store.run(f"s{m}", cfg, packed, np.flatnonzero(keep[m]), 0, queries)
                   for m in range(4)], 1)
  assert np.all(np.isfinite(meas)) and np.ptp(meas, 1).min() > 0  # subsets change the loss
  np.testing.assert_allclose(lds.lds_per_query(scores, keep, meas),
                             _reference_lds(scores, keep, meas), rtol=1e-12)
  again = retrain.retrain(cfg, packed, np.flatnonzero(keep[0]), 0)[0]
  np.testing.assert_array_equal(retrain.measure(again, queries), meas[:, 0])  # deterministic
  mtime = os.path.getmtime(store.path("s0"))
  np.testing.assert_array_equal(store.run("s0", cfg, packed, [], 0, queries), meas[:, 0])
  assert os.path.getmtime(store.path("s0")) == mtime  # skipped: [] would not even train


@pytest.mark.parametrize("flags, match", [
    (["--subsets=2"], "needs >= 3"),
    (["--methods=prism,ekfac", "--choose_among=trak"], "are not in --methods")])
def test_lds_cli_bad_flag_is_one_line(tmp_path, flags, match):
  r = subprocess.run([sys.executable, "-m", "experiments.lds", f"--out={tmp_path}", *flags],
                     capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert r.returncode == 2 and match in r.stderr.strip().splitlines()[-1], r.stderr


def test_lds_plot_from_results_draws_every_curve_inside_the_figure(tmp_path):
  """--plot_from redraws the removal curves from a results JSON alone; nothing is clipped
  at the figure's edges (the y label once was)."""
  rng = np.random.default_rng()
  ms = [8, 16, 32]
  ci = {}
  for name in ("prism", "full", "random"):
    mean = np.cumsum(rng.uniform(0.1, 1.0, len(ms)))
    half = rng.uniform(0.05, 0.5, len(ms))
    ci[name] = [[float(m), float(m - h), float(m + h)] for m, h in zip(mean, half)]
  (tmp_path / "lds.json").write_text(json.dumps({"removal_m": ms, "removal_ci": ci}))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  png = tmp_path / "removal.png"
  r = subprocess.run([sys.executable, "-m", "experiments.lds", f"--plot={png}",
                      f"--plot_from={tmp_path / 'lds.json'}"], capture_output=True, text=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root), cwd=root)
  assert r.returncode == 0, r.stderr[-2000:]
  import matplotlib.image  # pylint: disable=import-outside-toplevel
  img = matplotlib.image.imread(str(png))[..., :3]
  assert img.shape[:2] == (480, 720)  # 6 x 4 in at 120 dpi
  dark = img.min(axis=2) < 0.5
  edges = (dark[:, :2], dark[:, -2:], dark[:2, :], dark[-2:, :])
  assert not any(e.any() for e in edges)  # no text or line runs off the figure
  # every method's curve is drawn, in matplotlib's colour cycle (C0, C1, C2 in file order)
  for colour in ("#1f77b4", "#ff7f0e", "#2ca02c"):
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    assert (np.abs(img - rgb).max(axis=2) < 0.1).sum() > 300, colour
  r = subprocess.run([sys.executable, "-m", "experiments.lds", f"--plot_from={png}"],
                     capture_output=True, text=True, cwd=root,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
  assert r.returncode == 2 and "needs --plot" in r.stderr.strip().splitlines()[-1]
  (tmp_path / "other.json").write_text(json.dumps({"removal_ci": ci}))  # no removal_m
  r = subprocess.run([sys.executable, "-m", "experiments.lds", f"--plot={png}",
                      f"--plot_from={tmp_path / 'other.json'}"], capture_output=True,
                     text=True, cwd=root,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
  last = r.stderr.strip().splitlines()[-1]
  assert r.returncode == 2 and last.startswith("error: ") and "removal_m" in last, r.stderr


def _key(micro, **changes):
  cfg, packed, queries, _ = micro
  cfg = apply_overrides(cfg, changes.pop("overrides", []))
  toks = np.asarray(packed.rows("train")["tokens"][:ROWS])
  return retrain.content_key(toks, changes.pop("queries", queries), cfg,
                             changes.pop("commit", "c0"), {"alpha": 0.5, **changes})


def test_store_refuses_another_key_and_unkeyed_results(micro, tmp_path):
  """A resumed store with another config, protocol, query set or commit is refused in one
  line naming the difference; the stored results are left as they were."""
  d = str(tmp_path / "retrains")
  retrain.RetrainStore(d, _key(micro))
  (tmp_path / "retrains" / "x.npz").write_bytes(b"stored")
  retrain.RetrainStore(d, _key(micro))  # the same key resumes
  _, _, queries, _ = micro
  fewer = retrain.Queries(queries.tokens_QxL[:2], queries.mask_QxT[:2])
  for changed, match in [({"overrides": ["loss.lambda_proto=1"]}, r"loss.lambda_proto 0.0 "
                          r"there, 1.0 here"),
                         ({"alpha": 0.25}, "protocol.alpha 0.5 there, 0.25 here"),
                         ({"queries": fewer}, "queries "), ({"commit": "c1"}, "commit c0 there")]:
    with pytest.raises(retrain.KeyMismatchError, match=match) as e:
      retrain.RetrainStore(d, _key(micro, **changed))
    assert "\n" not in str(e.value)
  assert (tmp_path / "retrains" / "x.npz").read_bytes() == b"stored"
  (tmp_path / "old").mkdir()
  (tmp_path / "old" / "full_s0.npz").write_bytes(b"older run")
  with pytest.raises(retrain.KeyMismatchError, match="without a content key"):
    retrain.RetrainStore(str(tmp_path / "old"), _key(micro))


def test_lds_recipe_pins_every_model_option_and_loss_weight():
  """A new ModelConfig / LossConfig field (or a preset's move) cannot change the LDS model
  silently: each must be written in RECIPE."""
  from experiments import lds_recipe  # pylint: disable=g-import-not-at-top
  from prism_jax.config import Config  # pylint: disable=g-import-not-at-top
  from prism_jax.config import flatten  # pylint: disable=g-import-not-at-top
  fields = set(flatten(Config()))
  pinned = set(lds_recipe.RECIPE)
  unpinned = {f for f in fields if f.startswith(lds_recipe.UNPINNED)}
  assert pinned | unpinned == fields and not pinned & unpinned
  assert {f for f in fields if f.startswith(("model.", "loss."))} <= pinned
  cfg = lds_recipe.config(["loss.lambda_proto=1", "loss.lambda_proto_kl=0"])
  assert (cfg.loss.lambda_proto, cfg.loss.lambda_proto_kl) == (1.0, 0.0)
  assert flatten(lds_recipe.config())["loss.lambda_proto_kl"] == 1.0


def test_lds_cli_refuses_a_changed_flag_on_resume(tmp_path):
  """--dry_run claims the workdir for its key; the same run with one --set changed is
  refused with one line before anything trains."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  base = [sys.executable, "-m", "experiments.lds", f"--out={tmp_path}", "--num_rows=64",
          "--queries=4", "--removal_queries=2", "--removal_m=8", "--dry_run"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  r = subprocess.run(base, capture_output=True, text=True, env=env, cwd=root)
  assert r.returncode == 0, r.stderr[-2000:]
  assert (tmp_path / "retrains" / "KEY.json").exists() and (tmp_path / "scores" /
                                                             "KEY.json").exists()
  r = subprocess.run(base + ["--set=loss.lambda_proto=1"], capture_output=True, text=True,
                     env=env, cwd=root)
  last = r.stderr.strip().splitlines()[-1]
  assert r.returncode == 2 and last.startswith("error: ") and "loss.lambda_proto" in last, \
      r.stderr[-2000:]
  assert not list((tmp_path / "retrains").glob("*.npz"))


def test_removal_curves_off_gives_a_table_without_them():
  """--removal_queries=0 (documented: removal curves off) used to end in an IndexError
  after every retrain; now its report says the curves are off and has no removal rows."""
  gap = np.random.default_rng(0).random(5)
  lines, ci = lds_removal.removal_section({"prism": np.zeros((0, 2)), "ekfac": np.zeros((0, 2))},
                                      [4, 8], gap)
  assert ci == {} and lines[-1] == "removal curves: off (--removal_queries=0)"
  deltas = {"prism": np.random.default_rng(1).normal(size=(3, 2))}
  lines, ci = lds_removal.removal_section(deltas, [4, 8], gap)
  assert len(ci["prism"]) == 2 and lines[-1].startswith("| prism | ")
  np.testing.assert_allclose(ci["prism"][0][0], deltas["prism"][:, 0].mean())



def test_a_registered_method_is_scored_like_the_built_in_ones(micro):
  """methods.register adds a Method; scores() densifies its (ids, scores) over the rows."""
  methods_lib = methods
  rng = np.random.default_rng(secrets.randbits(32))
  picked = np.sort(rng.choice(6, 3, replace=False))
  vals = rng.normal(size=(2, 3))

  @methods_lib.register("test_sparse_method")
  def _method(setting):
    assert setting.num_rows == 6 and setting.seed == 5
    return picked, vals

  try:
    with pytest.raises(ValueError, match="already registered"):
      methods_lib.register("test_sparse_method")(_method)
    queries = type("Q", (), {"tokens_QxL": np.zeros((2, 4))})()
    out, _ = methods_lib.scores("test_sparse_method", None, None, None, queries, 6, "",
                                seed=5)
    want = np.zeros((2, 6))
    want[:, picked] = vals
    np.testing.assert_array_equal(out, want)
    assert methods_lib.METHODS == ("prism", "full", "ekfac", "ekfac[bank]", "ekfac[last]",
                                   "ekfac[early]", "ekfac[bank+last]", "ekfac[last+early]",
                                   "ekfac_cached[early]", "ekfac_cached[last+early]",
                                   "ekfac_cached[bank+last+early]", "ekfac_cached_r1024[early]",
                                   "grad_dot", "trak", "random")
  finally:
    methods_lib.REGISTRY.pop("test_sparse_method", None)
