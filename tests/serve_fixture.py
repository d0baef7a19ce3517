"""One tiny trained PRISM run behind the explorer (prism_jax/serve), built once per test
process and shared by test_serve_api, test_serve_safety, test_serve_browser and
test_serve_fuzz. Context 64: two length buckets (32, 64), so bucketing is exercised."""

import asyncio

import httpx
import numpy as np

WORDS = ["for", "while", "the", "of", "prototype", "token", "mesh", "return", "def"]
SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=4", "model.vocab_size=258", "model.max_len=64", "data.tokenizer=byte",
    "data.seq_len=64", "data.val_fraction=0.1", "train.batch_size=8", "train.steps=6",
    "train.warmup_steps=1", "train.proto_init_step=0", "train.eval_every=6",
    "train.eval_batches=1",
]
_RUN = {}


def served(tmp_path_factory) -> dict:
  """{run, app, explorer, model, tok}: the run trained and its explorer warmed on first use."""
  if not _RUN:
    from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
    from prism_jax.serve import server  # pylint: disable=g-import-not-at-top
    from prism_jax.train import apply_overrides, train  # pylint: disable=g-import-not-at-top
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(11)
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 12))
                                                 for _ in range(100)))
    cfg = apply_overrides(preset("tiny"), SETS + [f"data.sources={root / 'corpus.txt'}"])
    run = str(root / "run")
    train(cfg, run)
    app, explorer = server.build(run)
    _RUN.update(run=run, app=app, explorer=explorer, model=explorer.run.model,
                tok=explorer.run.tokenizer, cfg=explorer.run.config)
  return _RUN


def random_text(seed: int, words: int = 4) -> str:
  return " ".join(np.random.default_rng(seed).choice(WORDS, words))


def call(app, method: str, path: str, **kw) -> httpx.Response:
  """One request to the ASGI app in process (httpx's ASGI transport, no socket), as a
  loopback client sends it (Host: 127.0.0.1, which the explorer answers to)."""
  async def go():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1") as c:
      return await c.request(method, path, **kw)
  return asyncio.run(go())
