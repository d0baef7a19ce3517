"""One tiny trained PRISM run, its attribution cache and packed data, built once per test
process and shared by test_cards and test_report_browser (both need a trained model)."""

import os

import numpy as np

from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.config import preset
from prism_jax.data import prepare_data
from prism_jax.loading import load_for_inference
from prism_jax.train import apply_overrides, train

K = 16
SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", f"model.num_prototypes={K}",
    "model.k=4", "model.vocab_size=258", "model.max_len=32", "data.tokenizer=byte",
    "data.seq_len=32", "data.val_fraction=0.1", "train.batch_size=8", "train.steps=6",
    "train.warmup_steps=1", "train.proto_init_step=0", "train.ckpt_every=6",
    "train.log_every=3", "train.eval_every=3", "train.eval_batches=1",
]
WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "<x>", "&amp;"]
_RUN = {}


def tiny_run(tmp_path_factory) -> dict:
  """{root, run, model, cfg, tok, packed, cache} of the shared run (trained on first use)."""
  if not _RUN:
    root = tmp_path_factory.mktemp("tiny_run")
    rng = np.random.default_rng(2)
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 12))
                                                 for _ in range(120)))
    cfg = apply_overrides(preset("tiny"), SETS + [f"data.sources={root / 'corpus.txt'}"])
    run = str(root / "run")
    train(cfg, run)
    model, cfg, tok = load_for_inference(run)
    packed = prepare_data(cfg.data, cfg.model.vocab_size, run)
    cache = cache_lib.build_cache(model, cfg, packed, os.path.join(str(root), "cache"),
                                  cache_lib.CacheConfig(batch_rows=8), progress=False)
    _RUN.update(root=root, run=run, model=model, cfg=cfg, tok=tok, packed=packed,
                cache=cache)
  return _RUN
