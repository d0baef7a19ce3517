"""The kernel layer's backward: one custom_vjp (one set of k bank scatters) vs the old two.

  JAX_PLATFORMS=cpu python -m benchmarks.bench_layer_backward \
      [--shapes=micro,tiny,small] [--bytes_only=large,xl] [--layer_shapes=micro,tiny,wide]

Old: `vjp.stats` (kernel statistics), the mixture (JAX autodiff) and `vjp.gather_mix`
(z_hat), each with its own backward, so the bank gets k scatter-adds of N fp32 rows from
z_hat and k more from the cosines. New (`vjp.layer`, the unsharded `run_with_options`):
one custom_vjp whose backward sums both terms per row and scatters once.

Part 1, backward only: the two backwards jitted on the same fixed kernel outputs
(random, consistent in shape and range; the cost does not depend on their values), XLA's
cost-model bytes and CPU time; `--bytes_only` shapes are compiled, never run. Part 2, the
whole layer (interpreted kernel forward, identical in both) under jax.value_and_grad.
Both report max |g_new - g_old| / max |g_old| for dz and dprotos.
"""

from absl import flags

from benchmarks import configs
from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernel_bench_lib as benchmark
from pallas_kernels.topk_reconstruct import api, vjp
from prism_jax.model.prototypes import mixture_weights

SHAPES = configs.layer_shapes()  # (N, D, K, k); `wide`: many tokens, a small bank
_SHAPES = flags.DEFINE_list("shapes", ["micro", "tiny", "small"], "backward only, timed")
_BYTES_ONLY = flags.DEFINE_list("bytes_only", ["large", "xl"],
                                "backward only, cost model (compiled, not run)")
_LAYER_SHAPES = flags.DEFINE_list("layer_shapes", ["micro", "tiny", "wide"],
                                  "whole layer, interpreted kernel, timed")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "z and bank dtype")
_DISTANCE = flags.DEFINE_enum("distance", "cosine", ["cosine", "sqeuclidean"], "")
_MIXTURE = flags.DEFINE_enum("mixture", "raw", ["raw", "normalized"], "")
_BACKEND = flags.DEFINE_enum("backend", "tpu", ["tpu", "gpu"],
                             "tpu: fori_loop over j (sequential); gpu: unrolled")
_ITERS = flags.DEFINE_integer("iters", 3, "timed repetitions (median reported)")


def old_backward(k, opts, mixture, res, cts):
  """What JAX's transpose of the old composition computes, from the same residuals."""
  z, p, valid, out, act = res
  cts_out, g_act, g_zhat = cts
  dw, _, dp_zhat = vjp._gather_mix_bwd(  # pylint: disable=protected-access
      opts.backend == "tpu", (act, out[1], p), g_zhat)
  _, mixture_vjp = jax.vjp(lambda s: mixture_weights(s, mixture), out[0])
  g_sim = cts_out[0] + mixture_vjp(g_act + dw)[0]
  dz, dp_stats, _ = vjp._stats_bwd(  # pylint: disable=protected-access
      k, opts, (z, p, valid, out), (g_sim,) + tuple(cts_out[1:]))
  return dz, dp_stats + dp_zhat


def new_backward(k, opts, mixture, res, cts):
  return vjp._layer_bwd(k, opts, mixture, res, cts)[:2]  # pylint: disable=protected-access


def old_layer(z, p, valid, k, opts, mixture):
  out = vjp.stats(z, p, valid, k, opts)
  act = mixture_weights(out[0], mixture)
  return out, act, vjp.gather_mix(act, out[1], p, opts.backend == "tpu")


def new_layer(z, p, valid, k, opts, mixture):
  return vjp.layer(z, p, valid, k, opts, mixture)


def _residuals(shape, dtype, sqeuclid: bool, seed: int | None):
  """(res, cts) of the layer's backward; ShapeDtypeStructs when seed is None."""
  n, d, num_protos, k = shape
  rng = np.random.default_rng(seed)
  if seed is None:
    arr = lambda shp, dt, hi=None: jax.ShapeDtypeStruct(shp, dt)
  else:
    def arr(shp, dt, hi=None):
      if hi is not None:
        return jnp.asarray(rng.integers(0, hi, shp), dt)
      return jnp.asarray(rng.standard_normal(shp, np.float32), dt)
  f32, i32 = jnp.float32, jnp.int32
  if seed is None:
    sim = act = arr((n, k), f32)
  else:  # sorted cosines, mostly positive so relu passes most pairs
    sim = jnp.asarray(-np.sort(-rng.uniform(-0.3, 1.0, (n, k)).astype(np.float32)), f32)
    act = mixture_weights(sim, _MIXTURE.value)
  out = (sim, arr((n, k), i32, num_protos), arr((num_protos,), f32), arr((num_protos,), i32, n))
  g_out = (arr((n, k), f32), None, arr((num_protos,), f32), None)
  if sqeuclid:
    out += (arr((n,), f32), arr((n,), i32, num_protos), arr((num_protos,), f32),
            arr((num_protos,), i32, n))
    g_out += (arr((n,), f32), None, arr((num_protos,), f32), None)
  valid = arr((n,), f32) if seed is None else jnp.asarray(rng.random(n) > 0.1, f32)
  res = (arr((n, d), dtype), arr((num_protos, d), dtype), valid, out, act)
  return res, (g_out, arr((n, k), f32), arr((n, d), f32))


def _rel_diff(new, old):
  return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                   / jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(new, old))


def _compare(label, name, fns, args, iters, run=True):
  """Rows for the old and new form of one program, then their ratio line."""
  lines, gb, ms, outs = [], {}, {}, {}
  for form, fn in fns.items():
    compiled = jax.jit(fn).lower(*args).compile()
    gb[form] = benchmark._cost(compiled)[1] / 1e9  # pylint: disable=protected-access
    if run:
      ms[form] = 1e3 * benchmark._time(compiled, args, iters)  # pylint: disable=protected-access
      outs[form] = compiled(*args)
    ms_text = f"{ms[form]:.1f}" if run else "(not run)"
    lines.append(f"| {label} | {name} | {form} | {gb[form]:.3f} | {ms_text} |")
  summary = f"bytes old/new {gb['old'] / gb['new']:.2f}x"
  if run:
    summary += f", time old/new {ms['old'] / ms['new']:.2f}x"
    grads = lambda o: o[1] if isinstance(o[1], tuple) else o  # value_and_grad or (dz, dp)
    summary += f", grad max rel diff {_rel_diff(grads(outs['new']), grads(outs['old'])):.1e}"
  lines.append(f"| {label} | {name} | {summary} | | |")
  return lines


def backward_rows(name, opts, dtype, mixture, run: bool, iters: int):
  _, _, _, k = SHAPES[name]
  res, cts = _residuals(SHAPES[name], dtype, opts.distance == "sqeuclidean",
                        0 if run else None)
  fns = {form: (lambda res, cts, f=f: f(k, opts, mixture, res, cts))
         for form, f in (("old", old_backward), ("new", new_backward))}
  return _compare("bwd only", name, fns, (res, cts), iters, run)


def layer_rows(name, opts, dtype, mixture, iters: int):
  """value_and_grad of a random-weighted sum of every differentiable layer output."""
  n, d, num_protos, k = SHAPES[name]
  rng = np.random.default_rng(1)
  z = jnp.asarray(rng.standard_normal((n, d), np.float32), dtype)
  p = jnp.asarray(rng.standard_normal((num_protos, d), np.float32), dtype)
  valid = jnp.asarray(rng.random(n) > 0.1, jnp.float32)
  shapes = jax.eval_shape(lambda: new_layer(z, p, valid, k, opts, mixture))
  weights = [jnp.asarray(rng.standard_normal(s.shape), jnp.float32)
             for s in jax.tree.leaves(shapes) if s.dtype == jnp.float32]

  def loss_of(layer):
    def loss(z, p):
      outs = [o for o in jax.tree.leaves(layer(z, p, valid, k, opts, mixture))
              if o.dtype == jnp.float32]
      return sum(jnp.sum(w * jnp.where(jnp.isfinite(o), o, 0.0))
                 for w, o in zip(weights, outs))
    return jax.value_and_grad(loss, (0, 1))
  fns = {"old": loss_of(old_layer), "new": loss_of(new_layer)}
  return _compare("layer fwd+bwd", name, fns, (z, p), iters)


def main(argv):
  del argv
  # each list may be empty (benchmarks/device_check.sh times part 1 alone), not all three
  for name, shapes in (("shapes", _SHAPES), ("bytes_only", _BYTES_ONLY),
                       ("layer_shapes", _LAYER_SHAPES)):
    check.known(name, shapes.value, SHAPES)
  if not (_SHAPES.value or _BYTES_ONLY.value or _LAYER_SHAPES.value):
    raise ValueError("--shapes, --bytes_only and --layer_shapes are all empty: nothing to measure")
  check.at_least(1, iters=_ITERS.value)
  dtype = jnp.dtype(_DTYPE.value)
  opts = api.KernelOptions(distance=_DISTANCE.value, backend=_BACKEND.value, interpret=True)
  print(f"backend {jax.default_backend()}, {_DTYPE.value}, {_DISTANCE.value}/"
        f"{_MIXTURE.value}, kernel {_BACKEND.value} (interpret); shapes (N, D, K, k): "
        + ", ".join(f"{s}={SHAPES[s]}" for s in
                    dict.fromkeys(_SHAPES.value + _BYTES_ONLY.value + _LAYER_SHAPES.value)))
  print("| part | shape | form | GB (XLA cost model) | ms |\n|---|---|---|---|---|")
  for names, rows in ((_SHAPES.value, lambda s: backward_rows(
      s, opts, dtype, _MIXTURE.value, True, _ITERS.value)),
                      (_BYTES_ONLY.value, lambda s: backward_rows(
                          s, opts, dtype, _MIXTURE.value, False, _ITERS.value)),
                      (_LAYER_SHAPES.value, lambda s: layer_rows(
                          s, opts, dtype, _MIXTURE.value, _ITERS.value))):
    for name in names:
      for line in rows(name):
        print(line, flush=True)


if __name__ == "__main__":
  launcher.run(main)
