"""The micro LDS setting shared by test_evaluation_lds.py and test_attribution_methods.py:
a tiny PRISM model retrained for 12 steps on the first ROWS packed training rows of the
tiny preset's data, and three validation queries with three target positions each."""

import numpy as np

from prism_jax.config import preset
from prism_jax.data import prepare_data
from prism_jax.attribution.quality import retrain
from prism_jax.train import apply_overrides

MICRO = ("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=32",
         "model.k=4", "model.max_len=16", "data.seq_len=16", "train.steps=12",
         "train.batch_size=8", "train.warmup_steps=2", "train.proto_init_step=4")
ROWS = 32  # training sequences of the micro run


def micro_setting(workdir: str):
  """(cfg, packed, queries, model) of the micro run, its data packed under `workdir`."""
  cfg = apply_overrides(preset("tiny"), list(MICRO))
  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  rows = packed.rows("val")
  toks = np.asarray(rows["tokens"][:3])
  mask = np.zeros((3, packed.seq_len), bool)
  mask[:, [4, 9, 14]] = True
  queries = retrain.Queries(toks, mask & (np.asarray(rows["offset"][:3, 1:]) > 0))
  model, _ = retrain.retrain(cfg, packed, np.arange(ROWS), 0)
  return cfg, packed, queries, model
