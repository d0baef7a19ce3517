r"""λ sweep of curvature localisation and conditioning of the prototype bank (PRISM.md §4).

  python -m experiments.hessian                       # λ = 0, 0.01, 0.05, 0.2, 1
  python -m experiments.hessian --lambdas=0,1 --steps=50 --distance=sqeuclidean
"""

from absl import flags

from prism_jax.cli import launcher

from prism_jax.attribution import hessian_sweep as sweep

_LAMBDAS = flags.DEFINE_list("lambdas", ["0", "0.01", "0.05", "0.2", "1"],
                             "clustering weights λ (λ_1 = λ_2 = λ)")
_STEPS = flags.DEFINE_integer("steps", 150, "training steps per λ")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "model/data seeds")
_DISTANCE = flags.DEFINE_enum("distance", "cosine", ["cosine", "sqeuclidean"],
                              "distance of the clustering terms R1/R2")
_D_MODEL = flags.DEFINE_integer("d_model", 16, "hidden size D")
_PROTOS = flags.DEFINE_integer("num_prototypes", 8, "bank size K (K·D <= 512)")
_K = flags.DEFINE_integer("k", 2, "active prototypes per token")


def main(argv):
  del argv
  cfg = sweep.SweepConfig(lambdas=tuple(float(x) for x in _LAMBDAS.value),
                          steps=_STEPS.value, seeds=tuple(int(s) for s in _SEEDS.value),
                          distance=_DISTANCE.value, d_model=_D_MODEL.value,
                          num_prototypes=_PROTOS.value, k=_K.value)
  print(f"# {cfg}")
  rows = sweep.run_sweep(cfg, log=lambda line: print(line, flush=True))
  print(sweep.table(rows))


if __name__ == "__main__":
  launcher.run(main)
