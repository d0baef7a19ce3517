"""Measuring a run on one val half (issue 44): the eval metrics and how many prototypes
carry a prediction. Flag-free, so tests import it beside other experiments' modules."""

import numpy as np


def step_seconds(workdir: str, cfg) -> float:
  from prism_jax.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  last = [r for r in read_metrics(workdir, "train") if "steady_tokens_per_s" in r][-1]
  return cfg.train.batch_size * cfg.data.seq_len / last["steady_tokens_per_s"]


def measure_half(workdir: str, half: str, half_seed: int) -> dict:
  """The run's final parameters on one val half: the eval metrics and the carriers."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from prism_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data.val_halves import HalfLoader, val_halves  # pylint: disable=g-import-not-at-top
  from prism_jax.model.lm import decompose  # pylint: disable=g-import-not-at-top
  from prism_jax.model.trust import carriers_N  # pylint: disable=g-import-not-at-top
  from prism_jax.train.validation import evaluate  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_params  # pylint: disable=g-import-not-at-top
  graphdef, params, cfg, _ = load_params(workdir)
  packed = data_lib.prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  docs = val_halves(packed, half_seed)[half]
  loader = HalfLoader(data_lib.make_loader(packed, "val", cfg.train.batch_size, cfg.data.seed),
                      docs)
  row = evaluate(graphdef, params, cfg, loader, num_batches=0)
  if cfg.model.kind != "prism":
    return row

  @jax.jit
  def contributions(params, inputs, mask):
    model = nnx.merge(graphdef, params)
    out = model(inputs, mask_BxT=mask)
    top1 = out.logits_BxTxV.reshape(-1, out.logits_BxTxV.shape[-1]).argmax(-1)
    return decompose(model, out.protos, top1).contrib_Nxk

  counts = []
  for i in range(loader.num_batches):
    b = loader.batch_at(i)
    contrib = np.asarray(contributions(params, b["inputs"], b["mask"]))
    counts.append(carriers_N(contrib)[np.asarray(b["mask"]).reshape(-1)])
  counts = np.concatenate(counts)
  row.update(carriers90_median=float(np.median(counts)),
             carriers90_p90=float(np.percentile(counts, 90)),
             documents=int(len(docs)))
  return row
