"""prism_jax.load (prism_jax/runs.py): one-line load, decompose against float64 NumPy,
trust marks, generation, display in a notebook and a terminal."""

import secrets

import numpy as np
import pytest

import prism_jax
from prism_jax.config import preset
from prism_jax.generate import generate
from prism_jax.train import apply_overrides, train

WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "return", "def"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  rng = np.random.default_rng(5)
  (root / "c.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(80)))
  cfg = apply_overrides(preset("tiny"), [
      "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
      "model.k=4", "model.vocab_size=258", "model.max_len=32", "data.tokenizer=byte",
      "data.seq_len=32", "data.val_fraction=0.1", "train.batch_size=8", "train.steps=4",
      "train.warmup_steps=1", "train.proto_init_step=0", "train.eval_every=4",
      "train.eval_batches=1", f"data.sources={root / 'c.txt'}"])
  train(cfg, str(root / "run"))
  return str(root / "run")


def test_decompose_matches_float64_numpy_with_trust(run_dir):
  run = prism_jax.load(run_dir)
  assert "K=16, k=4" in repr(run)
  seed = secrets.randbits(32)
  text = " ".join(np.random.default_rng(seed).choice(WORDS, 4))
  dec = run.decompose(text)
  ids = run.tokenizer.encode(text)
  assert len(dec.tokens) == len(ids) - 1
  # float64 reference from the backbone's z and the bank
  m = run.model
  z = np.asarray(m.backbone(np.asarray(ids[:-1])[None])[0][0], np.float64)
  w = np.asarray(m.backbone.wte[...], np.float64)[:run.config.model.num_token_ids]
  p = np.asarray(m.bank.protos[...], np.float64)
  cos = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (
      p / np.linalg.norm(p, axis=-1, keepdims=True)).T
  idx = np.argsort(-cos, -1, kind="stable")[:, :4]
  act = np.maximum(np.take_along_axis(cos, idx, -1), 0)
  act = act / act.sum(-1, keepdims=True)  # the tiny preset's normalised mixture
  z_hat = np.einsum("tk,tkd->td", act, p[idx])
  full, proto = z @ w.T, z_hat @ w.T
  for j, t in enumerate(dec.tokens):
    msg = f"seed {seed} position {t.position}"
    assert t.token == ids[j + 1]
    assert abs(sum(c for _, _, c in t.prototypes) + t.residual - t.logit) < 1e-4, msg
    assert abs(t.logit - full[j, ids[j + 1]]) < 1e-3 * max(1, abs(t.logit)), msg
    assert sorted(i for i, _, _ in t.prototypes) == sorted(idx[j].tolist()), msg
    mags = [abs(c) for _, _, c in t.prototypes]
    assert mags == sorted(mags, reverse=True), msg
    top2 = np.sort(full[j])[-2:]
    ptop2 = np.sort(proto[j])[-2:]
    if top2[1] - top2[0] > 1e-3 and ptop2[1] - ptop2[0] > 1e-3:  # rounding cannot flip it
      assert t.prediction == int(full[j].argmax()), msg
      assert t.agrees == (int(proto[j].argmax()) == int(full[j].argmax())), msg
  text_view = str(dec)
  assert len(text_view.splitlines()) == len(dec.tokens) + 2
  assert text_view.count("RESIDUAL") == len(dec.residual_decided) + 1  # + the closing line
  page = dec._repr_html_()
  assert page.startswith("<table>") and "<script" not in page
  assert page.count("<tr>") == len(dec.tokens) + 1


def test_generate_and_bad_input(run_dir):
  run = prism_jax.load(run_dir)
  greedy = run.generate("the token", max_new_tokens=5, greedy=True)
  ids = run.tokenizer.encode("the token")
  ref = generate(run.model, [ids], max_new_tokens=5, eos_id=run.tokenizer.eos_id)
  n = int(ref.lengths_B[0])
  assert greedy.text == run.tokenizer.decode(ref.tokens_BxL[0, :n].tolist())
  assert greedy.how == "greedy" and "trust:" in str(greedy)
  sampled = run.generate("the token", max_new_tokens=5)
  assert sampled.how == "temperature 0.8, top-k 40, seed 0"
  assert sampled.text == run.generate("the token", max_new_tokens=5).text  # seeded
  with pytest.raises(ValueError, match="at least two tokens"):
    run.decompose("a")
  with pytest.raises(ValueError, match="no tokens"):
    run.decompose("")


def test_a_steered_view_edits_generation_and_decomposition(run_dir):
  """suppress / steer against the edit computed here: l' = l - sum (1 - g_i) a_i W p_i."""
  run = prism_jax.load(run_dir)
  text = "the prototype of mesh"
  plain = run.decompose(text)
  top = plain.tokens[0].prototypes[0][0]
  quiet = run.suppress([top])
  assert "steered: 1 prototype gains != 1" in repr(quiet) and run.gains_K is None
  edited = quiet.decompose(text)
  for a, b in zip(plain.tokens, edited.tokens):
    removed = sum(c for i, _, c in a.prototypes if i == top)
    assert abs(b.logit - (a.logit - removed)) < 1e-4
    assert all(c == 0.0 for i, _, c in b.prototypes if i == top)
    assert abs(sum(c for _, _, c in b.prototypes) + b.residual - b.logit) < 1e-4
  doubled = run.steer({top: 2.0}).decompose(text)
  for a, b in zip(plain.tokens, doubled.tokens):
    added = sum(c for i, _, c in a.prototypes if i == top)
    assert abs(b.logit - (a.logit + added)) < 1e-4
  g = quiet.generate("the token", max_new_tokens=6, greedy=True)
  assert top not in set(g.output.trace.idx_BxLxk[0][g.output.trace.contrib_BxLxk[0] != 0])
  with pytest.raises(ValueError, match="prototype ids must be in"):
    run.suppress([10_000])
  with pytest.raises(ValueError, match="finite and >= 0"):
    run.steer({0: -1.0})



@pytest.mark.long
def test_attribute_and_report_from_the_run(run_dir):
  from prism_jax.attribution.scoring import influence  # pylint: disable=import-outside-toplevel
  from prism_jax.model.trust import prediction_trust  # pylint: disable=import-outside-toplevel
  run = prism_jax.load(run_dir)
  text = "the prototype of mesh"
  att = run.attribute(text, position=5, top=4)  # builds <run>/attribution_cache once
  ids = run.tokenizer.encode(text)
  scores = [s for _, s, _ in att.sequences]
  assert 0 < len(att.sequences) <= 4 and scores == sorted(scores, reverse=True)
  agrees = bool(prediction_trust(run.model, ids, [5]).agrees_N[0])
  assert att.agrees == agrees and bool(att.note) == (not agrees)
  # the same ranking as the cache's own query function
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=import-outside-toplevel
  from prism_jax.data import prepare_data  # pylint: disable=import-outside-toplevel
  packed = prepare_data(run.config.data, run.config.model.vocab_size, run_dir)
  cache = cache_lib.AttributionCache(f"{run_dir}/attribution_cache", run.model, run.config)
  want = influence.attribute(run.model, cache, ids[:6], [5],
                             cfg=influence.InfluenceConfig(top=4), packed=packed)
  assert [e for e, _, _ in att.sequences] == [int(e) for e in want.example_ids]
  assert "score" in str(att) and "<table>" in att._repr_html_()
  assert att.method == influence.METHOD_LABEL and f"by {att.method}" in str(att)
  with pytest.raises(ValueError, match="position must be in"):
    run.attribute(text, position=0)
  page = run.report("the token", max_new_tokens=4)
  assert page.html.startswith("<!DOCTYPE html>") and "only tokens the residual decided" in page.html
  frame = page._repr_html_()
  assert frame.startswith("<iframe srcdoc=") and "src=\"http" not in frame


def test_hessian_block_uses_the_runs_loss_or_refuses_its_term_in_one_line(run_dir):
  import dataclasses  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.hessians.hessian_block import hessian_block  # pylint: disable=g-import-not-at-top
  from prism_jax.data import batch as batch_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.runs import _packed  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  run = prism_jax.load(run_dir)
  assert run.config.loss.lambda_proto_kl > 0  # the tiny preset's loss has a W z_hat term
  with pytest.raises(ValueError, match=r"^loss\.lambda_proto_kl=.* is not modelled"):
    run.hessian_block(0, 1)
  loss = dataclasses.replace(run.config.loss, lambda_proto_kl=0.0, lambda_proto=0.0,
                             lambda_rlogit=0.0)
  val = _packed(run).rows("val")
  b = batch_lib.from_rows(np.asarray(val["tokens"][:2]), np.asarray(val["example_id"][:2]),
                          np.asarray(val["offset"][:2]), None)
  batch = {k: b[k] for k in ("inputs", "targets", "mask")}
  used = np.bincount(np.asarray(run.model(batch["inputs"]).protos.idx_Nxk).ravel(),
                     minlength=16)
  i = int(np.argmax(used))  # a prototype active on these rows: its diagonal block is not 0
  j = int(np.random.default_rng(secrets.randbits(32)).choice(np.delete(np.arange(16), i)))
  for a, c in ((i, i), (i, j)):
    got = run.hessian_block(a, c, rows=2, loss_cfg=loss)
    with jax.enable_x64(True):
      want = hessian_block(run.model, [batch], a, c, loss_cfg=loss)
    assert got.shape == (32, 32)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    if a == c:
      assert np.abs(got).max() > 0
      np.testing.assert_allclose(got, got.T, rtol=1e-6, atol=1e-9)


def test_cards_are_built_once_and_searchable(run_dir):
  run = prism_jax.load(run_dir)
  cards = run.cards
  assert len(cards) == 16 and run.cards is cards
  c = cards.card(3)
  assert c.proto_id == 3 and c.contexts
  word = c.contexts[0].trigger.strip() or c.contexts[0].trigger
  assert 3 in [p for p, _ in cards.search(word, where="trigger")]
  assert prism_jax.load(run_dir).cards.card(3) == c  # read back from <workdir>/cards


def test_ragged_prompts_are_batched_and_equal_one_at_a_time_greedy(run_dir):
  run = prism_jax.load(run_dir)
  rng = np.random.default_rng(secrets.randbits(32))
  texts = [" ".join(rng.choice(WORDS, n)) for n in (1, 2, 1, 3)]  # ragged token lengths
  many = run.generate(texts, max_new_tokens=5, greedy=True)
  assert [g.prompt for g in many] == texts
  for text, g in zip(texts, many):
    one = run.generate(text, max_new_tokens=5, greedy=True)
    assert g.text == one.text, text
    np.testing.assert_array_equal(g.output.trace.idx_BxLxk, one.output.trace.idx_BxLxk)
    assert g.output.tokens_BxL.shape[0] == 1
