"""Prototype cards: top contexts vs a brute-force ranking over every training token (a plain
forward, no cache code), the records-only path equal to the cache path, the on-disk format's
round trip and identity check, signatures/neighbours/map vs NumPy, and the bad inputs."""

import dataclasses
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from prism_jax import io_guard
from prism_jax.analysis import cards as cards_lib
from prism_jax.attribution.caching import cache_build, cache_format
from prism_jax.model.lm import build_model

import tiny_run

TOP_M, WINDOW = 5, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  run = tiny_run.tiny_run(tmp_path_factory)
  cfg, packed, model = run["cfg"], run["packed"], run["model"]
  cards = cards_lib.build_cards(model, cfg, packed, cache=run["cache"], top_m=TOP_M,
                                window=WINDOW, progress=False)
  return run["run"], cfg, packed, model, cards, run["cache"]


def _brute_force(model, packed):
  """Per prototype: [(activation, example_id, offset, row, column)] over every valid
  training token, by decreasing activation, ties in row-major token order (one plain
  forward over all rows)."""
  rows = packed.rows("train")
  tok, off = np.asarray(rows["tokens"]), np.asarray(rows["offset"][:, 1:])
  valid = off > 0  # a target whose input is in the same document
  out = model(jnp.asarray(tok[:, :-1]), mask_BxT=jnp.asarray(valid))
  idx = np.asarray(out.protos.idx_Nxk).reshape(valid.shape + (-1,))
  act = np.asarray(out.protos.act_Nxk, np.float64).reshape(valid.shape + (-1,))
  per = {}
  for r, c in zip(*np.nonzero(valid)):
    for i, a in zip(idx[r, c], act[r, c]):
      if a > 0:
        per.setdefault(int(i), []).append((a, int(rows["example_id"][r, c + 1]),
                                           int(off[r, c]), int(r), int(c)))
  return {i: sorted(v, key=lambda x: (-x[0], x[3], x[4])) for i, v in per.items()}


def test_top_contexts_equal_brute_force(setup):
  _, cfg, packed, model, cards, _ = setup
  brute = _brute_force(model, packed)
  num_tokens = int((packed.rows("train")["offset"][:, 1:] > 0).sum())
  assert len(cards) == cfg.model.num_prototypes
  checked = 0
  for i in range(cfg.model.num_prototypes):
    card, ref = cards.card(i), brute.get(i, [])
    assert card.usage == pytest.approx(len(ref) / num_tokens, abs=1e-12)
    assert sum(card.histogram["counts"]) == len(ref)
    got = [(c.activation, c.example_id) for c in card.contexts]
    assert len(got) == min(TOP_M, len(ref))
    np.testing.assert_allclose([a for a, _ in got], [a for a, *_ in ref[:TOP_M]], rtol=1e-5)
    assert len({(c.example_id, c.row, c.position) for c in card.contexts}) == len(got)
    for j, ctx in enumerate(card.contexts):
      # Up to ties: the context at rank j is one of the reference entries whose activation
      # equals rank j's within rounding (on either side of it; the order inside a near-tie
      # may differ by a rounding, which depends on the CPU's kernels).
      a_j = ref[j][0]
      tied = [e for e in ref if abs(e[0] - a_j) <= 1e-5 * a_j]
      match = [e for e in tied if (e[1], e[3], e[4]) == (ctx.example_id, ctx.row, ctx.position)]
      assert match, (i, j, (ctx.example_id, ctx.row, ctx.position), tied)
      _, e_ref, o_ref, r_ref, c_ref = match[0]
      # The trigger is the row's input token there; the window is the document's text.
      doc = packed.document_tokens(e_ref, with_eos=True)
      dec = packed.tokenizer.decode
      assert ctx.trigger == dec([int(packed.rows("train")["tokens"][r_ref, c_ref])])
      assert ctx.tokens_before == dec(doc[max(0, o_ref - 1 - WINDOW):o_ref - 1])
      assert ctx.tokens_after == dec(doc[o_ref:o_ref + WINDOW])
      assert ctx.text == ctx.tokens_before + ctx.trigger + ctx.tokens_after
      checked += len(tied) == 1
  assert checked > cfg.model.num_prototypes  # most contexts compared exactly


def test_signature_neighbours_map_label(setup):
  _, cfg, packed, model, cards, _ = setup
  sig = (np.asarray(model.bank.protos[...], np.float64)
         @ np.asarray(model.backbone.wte[...], np.float64).T)
  p = np.asarray(model.bank.protos[...], np.float64)
  unit = p / np.linalg.norm(p, axis=1, keepdims=True)
  cos = unit @ unit.T
  dec = packed.tokenizer.decode
  for i in (0, 7, tiny_run.K - 1):
    card = cards.card(i)
    order = np.argsort(-sig[i])
    assert [t for t, _ in card.promoted] == [packed.tokenizer.piece(int(t)) for t in order[:10]]
    np.testing.assert_allclose([v for _, v in card.demoted], np.sort(sig[i])[:10], rtol=1e-4)
    nb = np.argsort(-np.where(np.arange(len(cos)) == i, -np.inf, cos[i]))[:8]
    assert card.neighbours["ids"] == nb.tolist()
    np.testing.assert_allclose(card.neighbours["cosines"], cos[i, nb], atol=1e-6)
    assert card.label.startswith("heuristic")
  xy = np.array([c.map_xy for c in cards.cards])
  centred = unit - unit.mean(0)
  ref = centred @ np.linalg.svd(centred)[2][:2].T
  # PCA up to each axis's sign: the same coordinates.
  np.testing.assert_allclose(np.abs(xy), np.abs(ref), atol=1e-6)


def test_records_path_save_load_search(setup, tmp_path, monkeypatch):
  _, cfg, packed, model, cards, _ = setup
  out = str(tmp_path / "cards")
  # An interrupted records pass (the cards' own, in <out>/records) is resumed, not redone.
  # Records are written in whole chunks (object stores cannot patch one), so resume starts
  # at the batch holding the first unwritten token: stopping after two batches of 16 rows
  # with 64-token chunks leaves rows 0-15 written (rows hold ~31 tokens), so a resume's
  # first batch ends at row 32, where a start from scratch would end at row 16.
  rec_cfg = cache_format.CacheConfig(rank=None, chunk_tokens=64)
  io_guard.claim_output_dir(out, cards_lib.CARDS_KIND)
  done = []

  def stop(_, rows):
    done.append(rows)
    if len(done) == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    cache_build.write_records(model, cfg, packed, os.path.join(out, "records"), rec_cfg,
                              progress=False, on_batch=stop)
  resumed = []
  orig = cache_build.records_pass
  monkeypatch.setattr(cache_build, "records_pass", lambda *a, **kw: orig(
      *a, **{**kw, "on_batch": lambda _, rows: resumed.append(rows)}))
  rec = cards_lib.build_cards(model, cfg, packed, top_m=TOP_M, window=WINDOW, out_dir=out,
                              progress=False, records_cfg=rec_cfg)
  assert done == [16, 32] and resumed[0] == 32  # picks up after the first run's 16 rows
  assert rec.identity["source"] == "records"
  for a, b in zip(rec.cards, cards.cards):
    assert [c._replace(activation=0) for c in a.contexts] == \
        [c._replace(activation=0) for c in b.contexts]
    np.testing.assert_allclose([c.activation for c in a.contexts],
                               [c.activation for c in b.contexts], rtol=1e-6)
  loaded = cards_lib.CardSet.load(out, model=model)
  assert loaded.cards == rec.cards
  # A rerun resumes into the same directory (the records pass is finished: no recompute).
  batches = len(resumed)
  again = cards_lib.build_cards(model, cfg, packed, top_m=TOP_M, window=WINDOW, out_dir=out,
                                progress=False, records_cfg=rec_cfg)
  assert len(resumed) == batches  # no second records pass
  assert again.cards == rec.cards
  other = build_model(cfg.model, 4)
  with pytest.raises(cards_lib.CardsMismatchError, match="another model"):
    cards_lib.CardSet.load(out, model=other)
  hits = cards.search(["while"])
  assert hits and all(h > 0 for _, h in hits)
  for pid, h in hits:
    assert h == sum("while" in c.text.lower() for c in cards.card(pid).contexts)
  assert [p for p, _ in hits] == [p for p, _ in sorted(hits, key=lambda x: (-x[1], x[0]))]
  np_feat = cards.to_neuronpedia(3)
  assert np_feat["index"] == "3" and len(np_feat["activations"]) == len(cards.card(3).contexts)
  assert np_feat["frac_nonzero"] == cards.card(3).usage
  assert sum(np_feat["freq_hist_data_bar_heights"]) == sum(cards.card(3).histogram["counts"])


def test_bad_inputs(setup, tmp_path):
  _, cfg, packed, model, cards, cache = setup
  with pytest.raises(IndexError, match=f"out of range.*K={tiny_run.K}"):
    cards.card(tiny_run.K)
  with pytest.raises(IndexError, match="out of range"):
    cards.card(-1)
  dense_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kind="dense"))
  with pytest.raises(ValueError, match="need a PRISM run"):
    cards_lib.build_cards(build_model(dense_cfg.model, 0), dense_cfg, packed, progress=False)
  with pytest.raises(ValueError, match="top_m must be a positive int"):
    cards_lib.build_cards(model, cfg, packed, top_m=0, progress=False)
  with pytest.raises(cards_lib.CardsMismatchError, match="another checkpoint"):
    cards_lib.build_cards(build_model(cfg.model, 9), cfg, packed,
                          cache=cache, progress=False)
  with pytest.raises(ValueError, match="map_method='tsne'"):
    cards_lib.bank_map(np.random.default_rng(0).normal(size=(5, 3)), "tsne")
  if importlib.util.find_spec("umap") is None:  # the optional extra is not installed
    with pytest.raises(ImportError, match=r"\[umap\]"):
      cards_lib.bank_map(np.random.default_rng(0).normal(size=(5, 3)), "umap")
  with pytest.raises(ValueError, match="keyword"):
    cards.search(["  "])
  with pytest.raises(FileNotFoundError, match="not a prototype-card directory"):
    cards_lib.CardSet.load(str(tmp_path))
  run_like = tmp_path / "run"
  (run_like / "checkpoints").mkdir(parents=True)
  with pytest.raises(io_guard.OutputDirError, match="training run directory"):
    cards.save(str(run_like))


def test_cards_on_gcs(setup, gcs):
  """Cards go to gs:// like every other output (issue 19): saved into the emulator's
  bucket and loaded back equal, refused for another model as locally."""
  del gcs  # the emulator's environment is set for the session
  cards = setup[4]
  where = cards.save("gs://bucket/cards_test")
  assert where.startswith("gs://") and epath.Path(where).is_file()
  assert cards_lib.CardSet.load("gs://bucket/cards_test", model=setup[3]).cards == cards.cards
  with pytest.raises(cards_lib.CardsMismatchError, match="another model"):
    cards_lib.CardSet.load("gs://bucket/cards_test", model=build_model(setup[1].model, 4))


def test_neighbour_top_n_is_the_stable_argsort_ties_included():
  """card_stats' partial top-n equals a full stable argsort, on rows with and without ties."""
  from prism_jax.analysis.card_stats import _top_n_stable  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng()
  for trial in range(60):
    m, k = int(rng.integers(1, 30)), int(rng.integers(2, 60))
    n = int(rng.integers(1, k + 1))
    sim = (rng.integers(0, 4, (m, k)).astype(float) if trial % 2  # many ties
           else rng.standard_normal((m, k)))
    want = np.argsort(-sim, axis=1, kind="stable")[:, :n]
    np.testing.assert_array_equal(_top_n_stable(sim, n), want)
