"""Issue 18's speed changes leave the maths alone: each against an independent reference.

- cpu.top_k (lax.top_k behind a CPU optimization barrier) returns lax.top_k's exact
  values, indices and gradients, ties, signed zeros and -inf included, and stays XLA:CPU's
  TopK call (no sort) under the mixture's gathers; the two-reduction first extremum is
  argmax / argmin exactly (ties, NaN, signed zeros, infinities);
- losses.token_nll (logsumexp - iota-picked logit) and its gradient against float64 NumPy;
- transformer.materialize (the CPU optimization barrier on the residual stream) changes no
  value: logits and gradients with it equal those without it to float32 rounding;
- transformer.matmul (the backbone's linear maps, with XLA:CPU's fast weight-gradient
  orientation on CPU): values and both gradients against float64 NumPy, and the model's
  loss, logits and gradients equal plain autodiff of x @ w;
- implementation "xla_sparse" (the XLA forward with the kernels' sparse backward, CPU's
  default) gives the XLA reference's outputs and, to float32 rounding, its autodiff
  gradients, ties, masks and meshes included, with one N x K x D matmul where autodiff has 3;
- flops counts the prototype path's head W z_hat where the loss computes it (λ_proto,
  λ_proto_kl, λ_rlogit);
- benchmarks.bench_train refuses a baseline that is not a checkout, times byte with the
  paper's four loss terms and with the tiny preset's loss, each with its analytic ratio; benchmarks.sparse_backward_drift refuses a dense model (and, with trace_train, bad flags);
  trace_train's time_alone counts the stretches with one op running, on a hand-made trace.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.topk_reconstruct import api, cpu, reference, vjp
from prism_jax import flops, losses, sharding
from prism_jax.config import LossConfig, MeshConfig, ModelConfig, preset
from prism_jax.model import build_model
from prism_jax.model import transformer
from prism_jax.model.prototypes import prototype_layer
from test_sharding_prototypes import assert_layer_matches


@pytest.mark.parametrize("k", [1, 3, 8, 47])
def test_top_k_equals_lax_top_k_with_ties_signed_zeros_and_inf(k):
  rng = np.random.default_rng(k)
  x = np.round(rng.normal(size=(37, 48)), 1).astype(np.float32)  # many exact ties
  x[rng.random(x.shape) < 0.1] = 0.0
  x[rng.random(x.shape) < 0.1] = -0.0
  x[rng.random(x.shape) < 0.2] = -np.inf
  x[0] = -np.inf  # a row with nothing but -inf
  vals, idx = jax.jit(cpu.top_k, static_argnums=1)(x, k)
  ref_vals, ref_idx = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  np.testing.assert_array_equal(np.signbit(vals), np.signbit(ref_vals))
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))


def test_top_k_in_the_mixture_is_xla_cpus_topk_call_not_a_sort():
  """Without the barrier, XLA:CPU turns lax.top_k into a sort of every row once the
  mixture's gathers consume it (~8x slower at K 8192)."""
  cos = jnp.asarray(np.random.default_rng(3).normal(size=(64, 256)), jnp.float32)
  protos = jnp.asarray(np.random.default_rng(4).normal(size=(256, 16)), jnp.float32)
  for fn in (lambda c, p: vjp._mix(*cpu.top_k(c, 8), p, False),):  # pylint: disable=protected-access
    hlo = jax.jit(fn).lower(cos, protos).compile().as_text()
    assert 'custom_call_target="TopK"' in hlo and " sort(" not in hlo


def test_the_reference_op_keeps_the_topk_call_with_all_its_outputs():
  """The XLA reference (the attribution cache's head) returning every output: its first
  similarity column sliced beside the mixture's gathers turned the top-k into a sort of
  every row (2.0 s against 0.17 s at 2048 x 16384); its top-k sits behind the barrier."""
  rng = np.random.default_rng(5)
  z = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
  protos = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
  fn = lambda z, p: reference.topk_reconstruct_xla(z, p, 8, mixture="normalized")
  hlo = jax.jit(fn).lower(z, protos).compile().as_text()
  assert 'custom_call_target="TopK"' in hlo and " sort(" not in hlo
  got = jax.jit(fn)(z, protos)
  want_sim, want_idx = jax.lax.top_k(reference.similarity(z, protos).cos_NxK, 8)
  np.testing.assert_array_equal(np.asarray(got.idx_Nxk), np.asarray(want_idx))
  np.testing.assert_allclose(np.asarray(got.row_max_cos_N), np.asarray(want_sim[:, 0]),
                             rtol=0, atol=1e-6)


def test_first_extremum_is_argmax_argmin_with_ties_nan_and_signed_zeros():
  rng = np.random.default_rng(5)
  x = np.round(rng.normal(size=(33, 29)), 1).astype(np.float32)
  x[rng.random(x.shape) < 0.1] = 0.0
  x[rng.random(x.shape) < 0.1] = -0.0
  x[:, 7] = -np.inf
  x[5] = np.inf
  x[3, 4] = x[3, 9] = np.nan
  for axis in (0, 1, -1):
    for largest, np_arg in ((True, np.argmax), (False, np.argmin)):
      val, arg = jax.jit(reference.first_extremum, static_argnums=(1, 2))(  # pylint: disable=protected-access
          x, axis, largest)
      want = np_arg(x, axis=axis)
      np.testing.assert_array_equal(np.asarray(arg), want)
      np.testing.assert_array_equal(
          np.asarray(val), np.squeeze(np.take_along_axis(x, np.expand_dims(want, axis), axis), axis))


def test_top_k_gradient_goes_to_the_selected_entries():
  rng = np.random.default_rng(0)
  x = np.round(rng.normal(size=(30, 20)), 1).astype(np.float32)
  ct = rng.normal(size=(30, 6)).astype(np.float32)
  grad = jax.grad(lambda a: jnp.vdot(cpu.top_k(a, 6)[0], ct))(x)
  _, idx = jax.lax.top_k(x, 6)
  expected = np.zeros_like(x)
  np.put_along_axis(expected, np.asarray(idx), ct, axis=1)  # brute force: one-hot scatter
  np.testing.assert_array_equal(np.asarray(grad), expected)


def test_token_nll_and_gradient_vs_float64():
  rng = np.random.default_rng(1)
  logits = (rng.normal(size=(3, 5, 33)) * 4).astype(np.float32)
  targets = rng.integers(0, 33, size=(3, 5))
  ct = rng.normal(size=(3, 5))
  nll, vjp = jax.vjp(lambda l: losses.token_nll(l, jnp.asarray(targets)), logits)
  (grad,) = vjp(jnp.asarray(ct, jnp.float32))
  l64 = logits.astype(np.float64)
  lse = np.log(np.exp(l64 - l64.max(-1, keepdims=True)).sum(-1)) + l64.max(-1)
  ref = lse - np.take_along_axis(l64, targets[..., None], -1)[..., 0]
  softmax = np.exp(l64 - lse[..., None])
  ref_grad = ct[..., None] * (softmax - np.eye(33)[targets])
  np.testing.assert_allclose(np.asarray(nll), ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-6)
  inf_logits = logits.copy()
  inf_logits[0, 0, targets[0, 0]] = -np.inf  # an impossible target costs +inf, as before
  assert np.isposinf(np.asarray(losses.token_nll(inf_logits, jnp.asarray(targets)))[0, 0])


@pytest.fixture(scope="module")
def prism_model():
  cfg = ModelConfig(vocab_size=61, max_len=16, d_model=32, n_layers=2, n_heads=2,
                    num_prototypes=24, k=3)
  return build_model(cfg, seed=4)


def _loss_and_grads(model, tokens):
  graphdef, params = nnx.split(model)

  def loss(p):
    out = nnx.merge(graphdef, p)(tokens)
    return losses.cross_entropy(out.logits_BxTxV.reshape(-1, 61), tokens.reshape(-1),
                                jnp.ones(tokens.size, bool)), out.logits_BxTxV

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def test_materialize_changes_no_value(prism_model, monkeypatch):
  # The barrier is really in the CPU program (the comparison below would be vacuous else).
  assert "optimization_barrier" in str(jax.make_jaxpr(transformer.materialize)(jnp.ones(3)))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 61, size=(3, 16)), jnp.int32)
  (loss, logits), grads = _loss_and_grads(prism_model, tokens)
  monkeypatch.setattr(transformer, "materialize", lambda x: x)
  (ref_loss, ref_logits), ref_grads = _loss_and_grads(prism_model, tokens)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape_in,shape_w", [((3, 5, 16), (16, 40)), ((37, 40), (40, 16)),
                                              ((2, 4, 12), (12, 12))])
def test_matmul_values_and_gradients_vs_float64(shape_in, shape_w):
  rng = np.random.default_rng(sum(shape_in) + shape_w[1])
  x, w = rng.standard_normal(shape_in), rng.standard_normal(shape_w)
  g = rng.standard_normal(shape_in[:-1] + shape_w[1:])
  y, vjp_fn = jax.vjp(transformer.matmul, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
  dx, dw = vjp_fn(jnp.asarray(g, jnp.float32))
  x2, g2 = x.reshape(-1, shape_w[0]), g.reshape(-1, shape_w[1])
  np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), g @ w.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), x2.T @ g2, rtol=1e-5, atol=1e-5)
  # On CPU the backward is the custom one (the check above would be vacuous else).
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(transformer.matmul(
      jnp.asarray(x, jnp.float32), w))))(jnp.asarray(w, jnp.float32)))
  assert "optimization_barrier" in jaxpr


def test_model_with_matmul_equals_plain_autodiff(prism_model, monkeypatch):
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 61, size=(3, 16)), jnp.int32)
  (loss, logits), grads = _loss_and_grads(prism_model, tokens)
  monkeypatch.setattr(transformer, "matmul", lambda x, w: x @ w)
  (ref_loss, ref_logits), ref_grads = _loss_and_grads(prism_model, tokens)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


def test_bench_train_refuses_a_baseline_that_is_not_a_checkout(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-m", "benchmarks.bench_train", "--config=byte",
                        f"--baseline={tmp_path}"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert res.returncode == 2
  assert res.stderr.strip().splitlines()[-1].startswith("error: --baseline=")
  assert "is not a checkout of prism_jax" in res.stderr


LAYER_FIELDS = ("idx_Nxk", "act_Nxk", "sim_Nxk", "z_hat_NxD", "residual_NxD",
                "row_max_cos_N", "col_max_cos_K", "row_min_dist_N", "col_min_dist_K")


def _tied_inputs(seed, n=48, num_protos=40, d=16):
  """Fresh random z and bank with exact ties: duplicate prototypes (row ties of the top-k
  and of the row extrema) and duplicate tokens (column ties of R1's extrema), a mask."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, d)).astype(np.float32)
  p = rng.normal(size=(num_protos, d)).astype(np.float32)
  p[[7, 23, 31]] = p[[2, 5, 2]]  # 7 and 31 copy 2, 23 copies 5
  z[[9, 30, 41]] = z[[4, 4, 17]]
  mask = rng.random(n) > 0.25
  mask[[4, 9]] = True
  return jnp.asarray(z), jnp.asarray(p), jnp.asarray(mask)


def _layer_objective(k, distance, mixture, implementation, seed):
  """<outputs, fresh random cotangents> over every differentiable output of the layer."""
  def value(z, p, mask):
    out = prototype_layer(z, p, k, mask_N=mask, distance=distance, mixture=mixture,
                          residual_routing="plain", implementation=implementation)
    rng = np.random.default_rng(seed)
    fin = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
    return sum(jnp.sum(fin(x) * rng.normal(size=x.shape).astype(np.float32))
               for x in out[1:]), out
  return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))


def _dots(fn, *args) -> list[tuple]:
  """Operand shapes of every dot_general in fn's jaxpr (sub-jaxprs included; of a
  platform_dependent, the branch a CPU program lowers)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(tuple(tuple(v.aval.shape) for v in eqn.invars))
      platforms = eqn.params.get("branches_platforms")
      if platforms is not None:
        cpu = next(i for i, ps in enumerate(platforms) if ps is None or "cpu" in ps)
        walk(eqn.params["branches"][cpu].jaxpr)
        continue
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns"):
            walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("distance,mixture", [("cosine", "raw"), ("sqeuclidean", "raw"),
                                              ("cosine", "normalized"),
                                              ("sqeuclidean", "normalized")])
def test_xla_sparse_matches_dense_autodiff_with_ties(distance, mixture):
  k, seed = 5, len(distance) + len(mixture)
  z, p, mask = _tied_inputs(seed)
  ref_fn = _layer_objective(k, distance, mixture, "xla", seed)
  (v0, ref), g0 = ref_fn(z, p, mask)
  sparse_fn = _layer_objective(k, distance, mixture, "xla_sparse", seed)
  (v1, out), g1 = sparse_fn(z, p, mask)
  idx = np.asarray(ref.idx_Nxk)
  assert (((idx == 2).any(1) & (idx == 7).any(1)).any()  # top-k ties were taken
          and ((idx == 5).any(1) & (idx == 23).any(1)).any())
  for name in LAYER_FIELDS:  # the forward is the reference's ops: the same bits
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  assert_layer_matches(LAYER_FIELDS, list(ref), list(out), (v0, g0), (v1, g1),
                       "unsharded", tol=1e-5)
  # The sparse backward really ran: one N x K x D matmul (the forward), autodiff's three.
  n, num_protos = z.shape[0], p.shape[0]
  big = lambda fn: [s for s in _dots(fn, z, p, mask)
                    if sorted(map(len, s)) == [2, 2] and {n, num_protos} <= {x for t in s for x in t}]
  assert len(big(ref_fn)) == 3 and len(big(sparse_fn)) == 1, (big(ref_fn), big(sparse_fn))


@pytest.mark.parametrize("shape,distance", [((8, 1, 1), "sqeuclidean"), ((1, 2, 4), "cosine")])
def test_xla_sparse_on_meshes_matches_unsharded_autodiff(shape, distance):
  """Tokens split over 8 devices (the kernel path's shard_map) and the bank over `model`."""
  k, seed = 4, sum(shape)
  z, p, mask = _tied_inputs(seed, n=64, num_protos=32)
  (v0, ref), g0 = _layer_objective(k, distance, "raw", "xla", seed)(z, p, mask)
  with jax.set_mesh(sharding.make_mesh(MeshConfig(*shape))):
    (v1, out), g1 = _layer_objective(k, distance, "raw", "xla_sparse", seed)(z, p, mask)
  assert_layer_matches(LAYER_FIELDS, list(ref), list(out), (v0, g0), (v1, g1), shape,
                       tol=2e-5)


def test_xla_sparse_is_cpus_default_and_float64_stays_autodiff():
  assert api.resolve_implementation(None, "cpu") == "xla_sparse"
  assert api.kernel_options("xla_sparse", "cosine").backend == "xla"
  assert api.kernel_options("xla", "cosine") is None
  z, p, mask = _tied_inputs(3)
  with jax.enable_x64(True):
    z64, p64 = z.astype(jnp.float64), p.astype(jnp.float64)
    out = api.topk_reconstruct(z64, p64, 3, mask_N=mask, implementation="xla_sparse")
    ref = reference.topk_reconstruct_xla(z64, p64, 3, mask_N=mask)
    assert out[3].dtype == jnp.float64
    for a, b in zip(out, ref):
      np.testing.assert_array_equal(a, b)
    # forward mode (jax.hessian's) works: the float64 reference is plain autodiff
    jax.jvp(lambda q: api.topk_reconstruct(z64, q, 3, implementation="xla_sparse")[3],
            (p64,), (p64,))


def test_model_gradients_xla_sparse_vs_xla():
  """The whole PRISM loss (CE, REC, R1, R2, λ_proto CE of W z_hat) through PrismLM."""
  base = dict(vocab_size=61, max_len=16, d_model=32, n_layers=1, n_heads=2,
              num_prototypes=24, k=3, distance="sqeuclidean")
  loss_cfg = LossConfig(lambda_r1=0.3, lambda_r2=0.2, lambda_proto=1.0)
  rng = np.random.default_rng(8)
  tokens = jnp.asarray(rng.integers(0, 61, size=(3, 17)), jnp.int32)
  mask = jnp.asarray(rng.random((3, 16)) > 0.2)
  grads = {}
  for impl in ("xla", "xla_sparse"):
    model = build_model(ModelConfig(**base, implementation=impl), seed=5)
    graphdef, params = nnx.split(model)

    def loss(prm, graphdef=graphdef):
      m = nnx.merge(graphdef, prm)
      out = m(tokens[:, :-1], mask_BxT=mask)
      proto = m.proto_path_logits(out.protos, 3, 16)
      return losses.total_loss(out, tokens[:, 1:], mask, loss_cfg,
                               proto_logits_BxTxV=proto)[0]
    grads[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (v0, g0), (v1, g1) = grads["xla"], grads["xla_sparse"]
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    scale = float(np.max(np.abs(a)))
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-5 * scale)


def test_flops_count_the_proto_head_only_when_the_loss_computes_it():
  cfg = preset("tiny")
  t, d, v = cfg.data.seq_len, cfg.model.d_model, cfg.model.vocab_size
  assert cfg.loss.needs_proto_logits  # the tiny preset's loss computes W z_hat
  with_aux = flops.flops_per_token(cfg.model, t, cfg.loss)
  without = flops.flops_per_token(cfg.model, t, LossConfig())
  for lever in ("lambda_proto", "lambda_proto_kl", "lambda_rlogit"):
    assert flops.flops_per_token(cfg.model, t, LossConfig(**{lever: 0.5})) == with_aux
  assert with_aux["proto_lm_head"] == 2 * d * v and without["proto_lm_head"] == 0
  assert with_aux["train"] - without["train"] == 3 * 2 * d * v
  assert flops.flops_per_token(cfg.model, t) == without  # no loss: the four terms
  dense = flops.flops_per_token(dataclasses.replace(cfg.model, kind="dense"), t, cfg.loss)
  assert dense["proto_lm_head"] == 0 and dense["proto_fwd"] == 0


def test_bench_train_times_byte_with_and_without_the_aux_head():
  from benchmarks import bench_train  # pylint: disable=import-outside-toplevel
  assert bench_train.kinds("byte") == ("dense", "prism_paper", "prism")
  assert bench_train.kinds("small") == ("dense", "prism")
  aux = {k: bench_train.make_config("byte", k).loss.needs_proto_logits
         for k in ("prism_paper", "prism")}
  assert aux == {"prism_paper": False, "prism": True}
  assert bench_train.make_config("byte", "dense").model.kind == "dense"
  # the analytic 0.929 without the aux head, 0.898 with it (3 x 2·D·V per token)
  assert round(bench_train.analytic_ratio("byte", "prism_paper"), 3) == 0.929
  assert round(bench_train.analytic_ratio("byte", "prism"), 3) == 0.898


@pytest.mark.parametrize("module,args,message", [
    ("trace_train", ["--kind=prism_fast"], "--config='byte' --kind='prism_fast': choose a model"),
    ("trace_train", ["--config=huge"], "--config='huge' --kind='dense': choose a model"),
    ("trace_train", ["--steps=0"], "--steps must be >= 1, got 0"),
    ("sparse_backward_drift", ["--backward=matmul", "--kind=prism_fast"],
     "--config='byte' --kind='prism_fast': choose a model"),
])
def test_trace_and_drift_refuse_bad_flags(module, args, message):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-m", f"benchmarks.{module}"] + args, cwd=repo,
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                       check=False)
  assert res.returncode == 2
  assert res.stderr.strip().splitlines()[-1] == "error: " + message + (
      "" if "steps" in message else " of bench_train's configs ['byte', 'small', 'tiny']")


def test_sparse_backward_drift_refuses_a_dense_model():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-m", "benchmarks.sparse_backward_drift",
                        "--kind=dense"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert res.returncode == 2
  assert res.stderr.strip().splitlines()[-1].startswith("error: --config='byte' --kind='dense'")


def test_trace_train_time_alone_counts_only_stretches_with_one_op():
  """Hand-made trace: a on one thread 0-10, b on another 5-20, c 25-30, d 30-31 (touching
  c), x (not an op of the step) 0-100. Alone: a 0-5, b 10-20, c 25-30, d 30-31."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import json; from benchmarks.trace_train import time_alone; "
          "ev = [dict(ph='X', name=n, ts=t, dur=d, tid=i % 2) for i, (n, t, d) in enumerate("
          "[('a', 0, 10), ('b', 5, 15), ('c', 25, 5), ('d', 30, 1), ('x', 0, 100)])] + "
          "[dict(ph='M', name='thread_name')]; "
          "print(json.dumps(time_alone(ev, {'a', 'b', 'c', 'd'})))")
  res = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True)
  assert json.loads(res.stdout.strip().splitlines()[-1]) == {"a": 5, "b": 10, "c": 5, "d": 1}
