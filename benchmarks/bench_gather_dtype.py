"""z_hat's sparse gather on bf16 bank rows vs the same rows widened to fp32 first.

  JAX_PLATFORMS=cpu python -m benchmarks.bench_gather_dtype [--shapes=small,xl]

`vjp.gather_mix` (z_hat = sum_j a_j p[idx_j] and its sparse backward) used to receive the
bank already widened to fp32; it now gathers rows in the bank's dtype and widens after the
gather, which is exact. Prints XLA's cost-model bytes and the time of both forms, forward
and forward+backward, side by side, and checks that outputs and gradients are bitwise equal.
"""

from absl import flags

from benchmarks import configs
from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernel_bench_lib as benchmark
from pallas_kernels.topk_reconstruct import vjp

_SHAPES = flags.DEFINE_list("shapes", ["small", "xl"], f"subset of {list(configs.layer_shapes())}")
_ITERS = flags.DEFINE_integer("iters", 3, "timed repetitions (median reported)")


def compare(name: str, iters: int) -> list[str]:
  n, d, num_protos, k = configs.layer_shapes()[name]
  rng = np.random.default_rng(0)
  p = jnp.asarray(rng.standard_normal((num_protos, d)), jnp.bfloat16)
  w = jnp.asarray(rng.random((n, k)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, num_protos, (n, k)), jnp.int32)
  g = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  old, new = "fp32 rows (old)", "bf16 rows (new)"
  forms = {old: lambda w, p: vjp.gather_mix(w, idx, p.astype(jnp.float32), False),
           new: lambda w, p: vjp.gather_mix(w, idx, p, False)}
  lines, outs, ms = [], {}, {}
  for form, f in forms.items():
    for pass_, fn in (("fwd", f), ("fwd+bwd", lambda w, p, f=f: jax.vjp(f, w, p)[1](g))):
      compiled = jax.jit(fn).lower(w, p).compile()
      _, nbytes = benchmark._cost(compiled)  # pylint: disable=protected-access
      sec = benchmark._time(compiled, (w, p), iters)  # pylint: disable=protected-access
      ms[(form, pass_)] = 1e3 * sec
      outs[(form, pass_)] = jax.tree.leaves(compiled(w, p))
      lines.append(f"| {name} | {form} | {pass_} | {nbytes / 1e9:.2f} | "
                   f"{ms[(form, pass_)]:.0f} |")
  same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for pass_ in ("fwd", "fwd+bwd")
             for a, b in zip(outs[(old, pass_)], outs[(new, pass_)]))
  ratios = ", ".join(f"{pass_} {ms[(old, pass_)] / ms[(new, pass_)]:.2f}x"
                     for pass_ in ("fwd", "fwd+bwd"))
  lines.append(f"| {name} | old/new time: {ratios}; bitwise equal: {same} | | | |")
  return lines


def main(argv):
  del argv
  check.not_empty(shapes=_SHAPES.value)
  check.known("shapes", _SHAPES.value, configs.layer_shapes())
  check.at_least(1, iters=_ITERS.value)
  print(f"backend {jax.default_backend()}")
  print("| shape | form | pass | GB (XLA cost model) | ms |\n|---|---|---|---|---|")
  for name in _SHAPES.value:
    for line in compare(name, _ITERS.value):
      print(line, flush=True)


if __name__ == "__main__":
  launcher.run(main)
