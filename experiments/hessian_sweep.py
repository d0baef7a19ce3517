"""Clustering-weight sweep of the bank's curvature (PRISM.md §4) on micro PrismLMs.

For each λ (λ_1 = λ_2 = λ) a micro PrismLM is trained briefly from the SAME initial weights on
the same byte-tokenised batches (the standard library's pydoc topics text, so it runs
offline), then `hessian.curvature_report` measures, on held-out batches in float64, the
off-block mass share and condition numbers of the exact Hessian of that model's training
loss w.r.t. the bank. Training runs on the shared trainer (prism_jax.train.engine, Adam,
no checkpoints); the sweep is small enough for a few CPU minutes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from prism_jax.attribution.hessians import hessian as hs
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.data import batch as batch_lib
from prism_jax.losses import total_loss
from prism_jax.model.lm import build_model, init_prototypes_from_hidden
from prism_jax.train.engine import Trainer


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  lambdas: tuple[float, ...] = (0.0, 0.01, 0.05, 0.2, 1.0)
  d_model: int = 16
  num_prototypes: int = 8
  k: int = 2
  seq_len: int = 32
  batch_size: int = 8
  steps: int = 150
  lr: float = 3e-3
  lambda_rec: float = 0.05
  distance: str = "cosine"
  eval_rows: int = 4  # eval batch = eval_rows × seq_len tokens
  seeds: tuple[int, ...] = (0,)

  def __post_init__(self):
    if not self.lambdas or min(self.lambdas) < 0:
      raise ValueError(f"lambdas must be non-empty and >= 0, got {self.lambdas}")
    if self.num_prototypes * self.d_model > 512:
      raise ValueError("the sweep forms dense (K·D)² Hessians: keep K·D <= 512")


def byte_corpus() -> np.ndarray:
  """The pydoc topics text as bytes (vocab 256): available in every Python install."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
  return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def windows(tokens: np.ndarray, rows: int, seq_len: int, rng: np.random.Generator,
            lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
  """A batch of random windows inside tokens[lo:hi] (inputs, targets shifted by one)."""
  hi = len(tokens) if hi is None else hi
  starts = rng.integers(lo, hi - seq_len - 1, rows)
  return batch_lib.next_token(np.stack([tokens[s:s + seq_len + 1] for s in starts]))


def _sweep_loss(graphdef):
  """The training loss with (λ_rec, λ) read from the batch: traced, so one compilation
  of the shared train step serves the whole sweep."""
  def loss_fn(params, batch):
    out = nnx.merge(graphdef, params)(batch["inputs"], mask_BxT=batch["mask"])
    _, met = total_loss(out, batch["targets"], batch["mask"], LossConfig())
    lambdas = batch["lambdas"]
    loss = met["ce"] + lambdas[0] * met["rec"] + lambdas[1] * (met["r1"] + met["r2"])
    return loss, {"loss": loss}
  return loss_fn


def run_sweep(cfg: SweepConfig, log=print) -> list[dict[str, float]]:
  """Returns one row per (seed, λ): the CurvatureReport fields plus held-out CE."""
  tokens = byte_corpus()
  split = int(0.9 * len(tokens))
  mcfg = ModelConfig(vocab_size=256, max_len=cfg.seq_len, d_model=cfg.d_model, n_layers=1,
                     n_heads=2, num_prototypes=cfg.num_prototypes, k=cfg.k,
                     distance=cfg.distance, init_std=0.1)
  graphdef, _ = nnx.split(build_model(mcfg, 0))
  trainer = Trainer(_sweep_loss(graphdef), optax.adam(cfg.lr))
  rows = []
  for seed in cfg.seeds:
    base = build_model(mcfg, seed)
    rng = np.random.default_rng(seed)
    init_batch = windows(tokens, 16, cfg.seq_len, rng, 0, split)
    init_prototypes_from_hidden(base, jnp.asarray(init_batch["inputs"]), seed=seed)
    train = [windows(tokens, cfg.batch_size, cfg.seq_len, rng, 0, split)
             for _ in range(cfg.steps)]
    evalb = windows(tokens, cfg.eval_rows, cfg.seq_len, rng, split)
    init = nnx.to_pure_dict(nnx.state(base, nnx.Param))
    for lam in cfg.lambdas:
      lambdas = jnp.asarray([cfg.lambda_rec, lam], jnp.float32)
      fitted = trainer.fit(init, [dict(b, lambdas=lambdas) for b in train],  # same init
                           steps=cfg.steps, log_every=cfg.steps)
      model = nnx.merge(graphdef, fitted.state.params)
      out = model(jnp.asarray(evalb["inputs"]), mask_BxT=jnp.asarray(evalb["mask"]))
      eval_ce = total_loss(out, jnp.asarray(evalb["targets"]), jnp.asarray(evalb["mask"]),
                           LossConfig())[1]["ce"]
      loss_cfg = LossConfig(lambda_rec=cfg.lambda_rec, lambda_r1=lam, lambda_r2=lam)
      with jax.enable_x64(True):
        rep = hs.curvature_report(model, evalb, loss_cfg)
      row = {"seed": seed, "lambda": lam, "eval_ce": float(eval_ce), **rep.as_dict()}
      rows.append(row)
      log(format_row(row))
  return rows


COLUMNS = (("seed", "seed", "{:d}"), ("lambda", "λ", "{:g}"), ("eval_ce", "eval CE", "{:.3f}"),
           ("off_block_full", "off(H)", "{:.3f}"), ("off_block_linear", "off(H_lin)", "{:.3f}"),
           ("off_block_gn", "off(GN)", "{:.3f}"), ("off_block_kfac", "off(KFAC)", "{:.3f}"),
           ("kappa_full", "κ(H)", "{:.3g}"), ("kappa_linear", "κ(H_lin)", "{:.3g}"),
           ("kappa_kfac", "κ(KFAC)", "{:.3g}"), ("kappa_bound", "κ bound", "{:.3g}"),
           ("kfac_rel_error", "KFAC err", "{:.3f}"), ("linear_vs_full_rel", "lin/full err",
                                                     "{:.3f}"),
           ("mu_min", "μ_min", "{:.2g}"), ("dead_prototypes", "dead", "{:d}"))


def format_row(row: dict) -> str:
  return "| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |"


def table(rows: Sequence[dict]) -> str:
  head = "| " + " | ".join(name for _, name, _ in COLUMNS) + " |"
  sep = "|" + "---|" * len(COLUMNS)
  return "\n".join([head, sep] + [format_row(r) for r in rows])
