"""Evaluation on the val split: loss, perplexity and, for PRISM, the grounding metrics.

Grounding (PRISM.md §3) over the evaluated tokens D:
  r1_bar = mean_i max_{t in D} cos(p_i, z_t)     r2_bar = mean_{t in D} max_i cos(z_t, p_i)
  residual_share = sum ||r||^2 / sum ||z||^2     dead_prototypes = #{i never active on D}
Statistics accumulate on device across batches (one host transfer per evaluation).
"""

from __future__ import annotations

from typing import Any

import jax

from prism_jax.config import Config
from prism_jax.train import step as step_lib
from prism_jax.train.state import default_mesh, state_shardings


class Evaluator:
  """Callable `params -> metrics dict` over the first `train.eval_batches` batches of a
  loader (0: all of a one-pass loader, i.e. the whole val split). The record's `tokens` is
  the number of tokens it averaged over. For PRISM, `last_usage` holds how often each
  prototype was among a token's k active ones in the last evaluation ((K,) int64), the
  report's usage histogram that the trackers draw at each eval."""

  def __init__(self, graphdef, cfg: Config, param_shardings: Any, mesh, loader,
               num_batches: int | None = None):
    self.cfg, self.mesh, self.loader = cfg, mesh, loader
    self._step = step_lib.make_eval_step(graphdef, cfg, param_shardings, mesh)
    n = cfg.train.eval_batches if num_batches is None else num_batches
    total = loader.num_batches if loader is not None else 0
    if n == 0 and total is None:
      raise ValueError("eval_batches=0 (the whole split) needs a one-pass loader; the "
                       f"{loader.split} loader is infinite: give a number of batches")
    n = total if n == 0 else n
    self.num_batches = n if total is None else min(n, total)
    self.last_usage = None

  def __call__(self, params) -> dict[str, float]:
    if self.loader is None:
      return {}
    stats = step_lib.eval_stats_init(self.cfg)
    for i in range(self.num_batches):
      batch = step_lib.device_batch(self.loader.batch_at(i), self.mesh, self.cfg.train.batch_size)
      stats = self._step(params, batch, stats)
    out = step_lib.eval_stats_finalize(stats)
    self.last_usage = out.pop("usage", None)
    return out


def evaluate(graphdef, params, cfg: Config, loader, mesh=None,
             num_batches: int | None = None) -> dict[str, float]:
  """One-off evaluation of `params` on `loader` (e.g. from a notebook)."""
  mesh = default_mesh(cfg) if mesh is None else mesh
  with jax.set_mesh(mesh):
    shardings = state_shardings(cfg, mesh).params
    params = jax.device_put(params, shardings)
    return Evaluator(graphdef, cfg, shardings, mesh, loader, num_batches)(params)

