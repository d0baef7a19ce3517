"""The Mosaic kernel's declared cost (pallas_kernels/topk_reconstruct/tpu.py's
`pl.CostEstimate`) against a count from its own loop structure.

XLA's cost analysis of the compiled train step takes the kernel's FLOPs and bytes from that
declaration (a custom call is opaque to it), so the scale table's roofline is only as good
as it. The count here reads the traced `pallas_call` itself, not the formula: the FLOPs of
every dot_general in the kernel body times the grid's trip count, and the HBM<->VMEM
traffic of a pipeline that copies a block when its index (the BlockSpec's index map,
evaluated at every grid step in order, the last axis fastest) differs from the previous
step's, as Pallas TPU pipelining does.
"""

import functools
import math

import jax
import jax.extend  # noqa: F401  (jax.extend.core: the jaxpr types)
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_reconstruct import common, tpu

# Shapes per chip of the scale table's programs (tokens = rows x 1024 a chip, the bank's
# rows on that chip: K, or K/2 with the bank K-sharded on v5p), plus small ones; the last
# has one prototype block.
SHAPES = [  # (tokens, prototypes, d_model, dtype)
    (16 * 1024, 8192, 768, jnp.bfloat16),  # small on v5e-16, 16 rows a chip
    (10 * 1024, 16384, 1600, jnp.bfloat16),  # xl on v5e-16 with remat
    (64 * 1024, 8192, 1600, jnp.bfloat16),  # xl on v5p-16, K/2 a chip
    (512, 1024, 128, jnp.float32),
    (1024, 256, 128, jnp.float32),  # one prototype block: the bank is copied in once
]


def _pallas_call(n, k, d, dtype, sqeuclid, block_n=tpu.DEFAULT_BLOCK_N,
                 block_k=tpu.DEFAULT_BLOCK_K):
  """The kernel's traced pallas_call equation at padded shapes (nothing runs)."""
  n_pad, k_pad = common.round_up(n, block_n), common.round_up(k, block_k)
  s = jax.ShapeDtypeStruct
  f32 = jnp.float32
  args = (s((n_pad, d), dtype), s((k_pad, d), dtype), s((n_pad, 1), f32), s((1, k_pad), f32),
          s((n_pad, 1), f32), s((n_pad, 1), f32), s((1, k_pad), f32))
  fn = functools.partial(tpu.topk_stats_tpu, num_protos=k, kp=common.padded_k(16),
                         sqeuclid=sqeuclid, block_n=block_n, block_k=block_k)
  eqns = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"]
  assert len(eqns) == 1
  return eqns[0]


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def _body_counts(jaxpr, in_loop=False):
  """(dot FLOPs run once per grid step, primitive names seen, dots inside a loop or a
  branch): a dot in a while loop or a cond branch would run a data-dependent number of
  times, which a declared constant cannot hold."""
  flops, names, hidden = 0, set(), 0
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      dot = 2 * math.prod(out) * math.prod(lhs[a] for a in contract)
      if in_loop:
        hidden += 1
      else:
        flops += dot
    loop = in_loop or eqn.primitive.name in ("while", "cond", "scan")
    for sub in _sub_jaxprs(eqn):
      f, n, h = _body_counts(sub, loop)
      flops, names, hidden = flops + f, names | n, hidden + h
  return flops, names, hidden


def _traffic(eqn):
  """Bytes copied per block mapping over the grid: a copy at every step whose block index
  differs from the previous step's (the first step included)."""
  gm = eqn.params["grid_mapping"]
  steps = list(np.ndindex(*gm.grid))  # row-major: the last grid axis fastest
  out = []
  for bm in gm.block_mappings:
    closed = bm.index_map_jaxpr
    copies, last = 0, None
    for idx in steps:
      at = tuple(int(x) for x in jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *idx))
      copies += at != last
      last = at
    block = math.prod(bm.block_aval.shape)  # a squeezed (None) dimension is 1
    out.append(copies * block * jnp.dtype(bm.array_aval.dtype).itemsize)
  return out, gm.num_inputs, math.prod(gm.grid)


@pytest.mark.parametrize("sqeuclid", [False, True])
@pytest.mark.parametrize("n,k,d,dtype", SHAPES)
def test_declared_cost_matches_the_loop_structure(n, k, d, dtype, sqeuclid):
  eqn = _pallas_call(n, k, d, dtype, sqeuclid)
  declared = eqn.params["cost_estimate"]
  dot_flops, names, hidden = _body_counts(eqn.params["jaxpr"])
  traffic, num_inputs, trips = _traffic(eqn)
  # FLOPs: the MXU work, one (bn, D) x (D, bk) dot a grid step, nothing hidden in a loop;
  # the VPU's elementwise work (cosines, the top-k merge) is not declared
  assert hidden == 0 and dot_flops > 0
  assert declared.flops == trips * dot_flops
  # no exp/log/sqrt/rsqrt/...: the norms are computed by XLA outside the kernel
  assert declared.transcendentals == 0
  assert not names & {"exp", "exp2", "log", "log1p", "sqrt", "rsqrt", "tanh", "logistic",
                      "sin", "cos", "pow", "erf"}, names
  # bytes: the declaration is the two large operands' streams (z and the bank), exactly
  assert declared.bytes_accessed == traffic[0] + traffic[1], (declared, traffic)
  # what it leaves out (norm vectors, mask, the top-k lists and the per-block column
  # partials written back) is a few percent at the scale table's shapes
  left_out = sum(traffic) - declared.bytes_accessed
  assert 0 < left_out
  if dtype == jnp.bfloat16:
    assert left_out / sum(traffic) < 0.02, (left_out, sum(traffic))
  del num_inputs


def test_left_out_share_at_the_scale_tables_shapes():
  """What the declaration leaves out, printed for the record (pytest -s): the share of
  all traffic, and the declared FLOPs against a bare (N, D) x (D, K) product."""
  for n, k, d, dtype in SHAPES[:3]:
    eqn = _pallas_call(n, k, d, dtype, False)
    traffic, _, _ = _traffic(eqn)
    declared = eqn.params["cost_estimate"]
    share = 1 - declared.bytes_accessed / sum(traffic)
    print(f"N {n} K {k} D {d}: declared {declared.bytes_accessed / 1e6:.1f} MB of "
          f"{sum(traffic) / 1e6:.1f} MB ({100 * share:.2f}% left out)")
    assert declared.flops == 2 * n * k * d  # these shapes are whole blocks: no padding
