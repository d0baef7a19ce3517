"""PRISM retrofitted onto an imported Llama-family checkpoint (issue 54): the golden Llama
(GQA, untied head, rope scaling) imported as a dense run, a PRISM run started from it with
the backbone frozen, on text packed with the checkpoint's own tokenizer. The full logits
stay the import's to the bit; the bank is set from its hidden states and used; the run
loads, decomposes exactly, attributes through the cache, has cards, and the explorer serves
it in a real browser (slices summing to W z with the untied head). ~60 s: `make test-long`."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import prism_jax
from prism_jax import hf
from prism_jax.loading import load_for_inference
from prism_jax.train import apply_overrides, checkpoint, train

pytestmark = pytest.mark.long

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "hf_llama_family", "llama")
WORDS = ["the", "prototype", "of", "a", "token", "mesh", "for", "while", "Llama", "model"]


@pytest.fixture(scope="module")
def retrofit(tmp_path_factory):
  root = tmp_path_factory.mktemp("llama_retrofit")
  hf.import_hf(GOLDEN, str(root / "llama"))
  rng = np.random.default_rng(7)
  corpus = root / "corpus.txt"
  corpus.write_text("\n\n".join(" ".join(rng.choice(WORDS, 40)) for _ in range(160)))
  cfg = apply_overrides(checkpoint.load_config(str(root / "llama")), [
      "model.kind=prism", "model.num_prototypes=32", "model.k=4", "model.mixture=nnls",
      "model.proto_init_pick=uniform", f"train.init_from={root / 'llama'}",
      "train.trainable=prototypes", "train.proto_init_step=0", "train.steps=8",
      "train.batch_size=8", "train.warmup_steps=1", "train.eval_every=8",
      "train.eval_batches=0", "train.log_every=4", "train.ckpt_every=8", "data.seq_len=64",
      "data.val_fraction=0.2", f"data.sources={corpus}"])
  result = train(cfg, str(root / "prism"))
  return root, result


def test_frozen_bank_on_the_import_keeps_its_logits_and_is_used(retrofit):
  root, result = retrofit
  ev = result.eval
  assert ev["tokens"] >= 1000
  alive = 1 - ev["dead_prototypes"] / 32
  assert alive >= 0.95, ev  # every prototype selected on the held-out tokens
  assert 0 <= ev["agreement"] <= 1 and 0 <= ev["agreement_decisive"] <= 1
  dense, _, _ = load_for_inference(str(root / "llama"))
  prism, cfg, tok = load_for_inference(str(root / "prism"))
  assert cfg.model.arch == "llama" and tok.vocab_size == 1000
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 64)), jnp.int32)
  assert np.array_equal(np.asarray(prism(ids).logits_BxTxV),
                        np.asarray(dense(ids).logits_BxTxV))


def test_the_retrofit_decomposes_attributes_and_has_cards(retrofit):
  root, _ = retrofit
  run = prism_jax.load(str(root / "prism"))
  text = "the prototype of a token mesh for the model"
  dec = run.decompose(text)
  assert len(dec.tokens) >= 5
  for t in dec.tokens:  # logit = Σ prototype slices + residual
    assert t.logit == pytest.approx(sum(c for _, _, c in t.prototypes) + t.residual,
                                    rel=1e-5, abs=1e-4)
  att = run.attribute(text, top=3)
  assert len(att.sequences) == 3 and att.query_prototypes
  card = run.cards.card(att.query_prototypes[0])
  assert card.contexts


def test_the_explorer_serves_the_retrofit_in_the_browser(retrofit):
  pytest.importorskip("starlette")
  from prism_jax.analysis import browser  # pylint: disable=g-import-not-at-top
  from prism_jax.serve import server  # pylint: disable=g-import-not-at-top
  root, _ = retrofit
  app, explorer = server.build(str(root / "prism"))
  model = explorer.run.model
  with server.running(app) as url, browser.open_url(url + "/") as view:
    page = view.page
    page.wait_for_function("document.getElementById('runinfo').textContent.includes('K 32')")
    page.fill("#prompt", "the prototype of a")
    page.fill("#max_new", "6")
    page.click("#generate")
    page.wait_for_function("document.getElementById('genmsg').textContent.includes('tokens')")
    ids = page.evaluate("S.gen.ids")
    tok = page.query_selector_all("#output .tok:not(.prompt)")[0]
    tok.click()
    page.wait_for_selector("#why:not([hidden])")
    i = int(tok.get_attribute("data-i"))
    slices = page.eval_on_selector_all("#slices tr.slice", "rs => rs.map(r => +r.dataset.v)")
    z = np.asarray(model.backbone(np.asarray(ids[:-1])[None])[0][0], np.float64)
    w = np.asarray(model.backbone.unembedding(), np.float64)  # the untied LM head
    assert abs(sum(slices) - (z @ w.T)[i - 1, ids[i]]) < 1e-4
    assert not view.errors, view.errors
