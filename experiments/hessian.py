r"""λ sweep of curvature localisation and conditioning of the prototype bank (PRISM.md §4),
or (with --workdir) one exact D×D block of a trained run's bank beside its K-FAC block.

  python -m experiments.hessian                       # λ = 0, 0.01, 0.05, 0.2, 1
  python -m experiments.hessian --lambdas=0,1 --steps=50 --distance=sqeuclidean
  python -m experiments.hessian --workdir=runs/demo [--rows=8] [--results_json=block.json]
"""

import dataclasses
import json
import os
import time

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
from prism_jax.cli import provenance

from experiments import hessian_sweep as sweep

_LAMBDAS = flags.DEFINE_list("lambdas", ["0", "0.01", "0.05", "0.2", "1"],
                             "clustering weights λ (λ_1 = λ_2 = λ)")
_STEPS = flags.DEFINE_integer("steps", 150, "training steps per λ")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "model/data seeds")
_DISTANCE = flags.DEFINE_enum("distance", "cosine", ["cosine", "sqeuclidean"],
                              "distance of the clustering terms R1/R2")
_D_MODEL = flags.DEFINE_integer("d_model", 16, "hidden size D")
_PROTOS = flags.DEFINE_integer("num_prototypes", 8, "bank size K (K·D <= 512)")
_K = flags.DEFINE_integer("k", 2, "active prototypes per token")
_WORKDIR = flags.DEFINE_string("workdir", None, "a trained PRISM run: time one exact block "
                               "(the most co-used pair of prototypes) instead of the sweep")
_ROWS = flags.DEFINE_integer("rows", 8, "training rows of the block's loss (--workdir)")
_OUT = flags.DEFINE_string("results_json", None, "JSON file the block timing is written to")


def block(workdir: str, rows: int) -> dict:
  """Exact and K-FAC blocks (i, i), (i, j) of the run's bank; seconds of the exact ones."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.hessians import curvature_stats as cs  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.hessians import hessian_block as hb  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching.cache_format import iter_rows  # pylint: disable=g-import-not-at-top
  from prism_jax.config import LossConfig  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  if rows <= 0:
    raise ValueError(f"--rows must be positive, got {rows}")
  model, cfg, _ = load_for_inference(workdir, needs_prototypes="a Hessian block")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  batches = [b for _, b in iter_rows(packed, "train", 4, 0, rows)]
  loss = dataclasses.replace(cfg.loss, **{n: 0.0 for n in LossConfig.PROTO_LOGIT_TERMS})
  stats = cs.curvature_stats(model, batches, loss)
  a = stats.a_dense()
  i, j = (int(x) for x in np.unravel_index(np.argmax(a - np.diag(np.diag(a))), a.shape))
  out = {**provenance.record("experiments.hessian"), "workdir": workdir, "K": cfg.model.num_prototypes, "D": cfg.model.d_model,
         "tokens": int(sum(b["mask"].sum() for b in batches)), "i": i, "j": j,
         "load_average_1min": os.getloadavg()[0]}
  with jax.enable_x64(True):
    for name, (p, q) in (("ii", (i, i)), ("ij", (i, j))):
      t0, c0 = time.time(), time.process_time()  # CPU time too: the box may be shared
      h = hb.hessian_block(model, batches, p, q, loss_cfg=loss)
      out[f"seconds_{name}"] = time.time() - t0
      out[f"cpu_seconds_{name}"] = time.process_time() - c0
      k = hb.kfac_block(stats, p, q)
      out[f"rel_diff_{name}"] = float(np.linalg.norm(k - h) / np.linalg.norm(h))
      out[f"cosine_{name}"] = float(np.sum(h * k) / (np.linalg.norm(h) * np.linalg.norm(k)))
  return out


_SWEEP_FLAGS = ("lambdas", "steps", "seeds", "distance", "d_model", "num_prototypes", "k")


def check_flags() -> None:
  """Every flag combination, before any training or loading (one `error:` line). The two
  modes take different flags: one given to the mode that ignores it is refused."""
  given = lambda names: [f"--{n}" for n in names if flags.FLAGS[n].present]
  if _WORKDIR.value is not None:
    if given(_SWEEP_FLAGS):
      raise ValueError(f"{', '.join(given(_SWEEP_FLAGS))}: sweep flags; --workdir times one "
                       "block instead (drop them or --workdir)")
    check.at_least(1, rows=_ROWS.value)
    check.existing("workdir", _WORKDIR.value, "run directory")
    check.output_file("results_json", _OUT.value)
    return
  if given(("rows", "results_json")):
    raise ValueError(f"{', '.join(given(('rows', 'results_json')))}: only with --workdir "
                     "(the sweep prints its table)")
  check.not_empty(lambdas=_LAMBDAS.value, seeds=_SEEDS.value)
  check.numbers("lambdas", _LAMBDAS.value, float, low=0)
  check.numbers("seeds", _SEEDS.value, int, low=0)
  check.at_least(1, steps=_STEPS.value, d_model=_D_MODEL.value,
                 num_prototypes=_PROTOS.value, k=_K.value)
  if _K.value > _PROTOS.value:
    raise ValueError(f"--k={_K.value}: at most --num_prototypes={_PROTOS.value}")
  if _PROTOS.value * _D_MODEL.value > 512:
    raise ValueError(f"--num_prototypes={_PROTOS.value} x --d_model={_D_MODEL.value}: the "
                     "sweep forms dense (K·D)² Hessians; keep K·D <= 512")


def main(argv):
  del argv
  check_flags()
  if _WORKDIR.value is not None:
    out = block(_WORKDIR.value, _ROWS.value)
    print(json.dumps(out, indent=1))
    if _OUT.value:
      provenance.write_results(_OUT.value, out)
    return
  cfg = sweep.SweepConfig(lambdas=tuple(float(x) for x in _LAMBDAS.value),
                          steps=_STEPS.value, seeds=tuple(int(s) for s in _SEEDS.value),
                          distance=_DISTANCE.value, d_model=_D_MODEL.value,
                          num_prototypes=_PROTOS.value, k=_K.value)
  print(f"# {cfg}")
  rows = sweep.run_sweep(cfg, log=lambda line: print(line, flush=True))
  print(sweep.table(rows))


if __name__ == "__main__":
  launcher.run(main)
