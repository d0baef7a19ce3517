"""benchmarks/scale_table.py and hlo_collectives: the HLO collectives read from a real
compiled CPU program and from TPU-style async text, the batch search against brute force,
the rows' roofline arithmetic and their rendering by experiments.reproduce. The AOT run
itself (libtpu) is the tpu_aot test at the end."""

import importlib.util
import json
import math
import os

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from benchmarks import hlo_collectives as hc
from benchmarks import scale_lib as scale_table
from results_md import document


def test_collectives_of_a_compiled_cpu_program():
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  shard = NamedSharding(mesh, P("x"))

  def f(a, b, c, d):
    ag = jax.lax.all_gather(a, "x", tiled=True)  # local (3, 5) -> (24, 5)
    rs = jax.lax.psum_scatter(b, "x", tiled=True)  # local (16, 7) -> (2, 7)
    ar = jax.lax.psum(c, "x")  # local (1, 11)
    a2a = jax.lax.all_to_all(d, "x", 1, 1, tiled=True)  # local (1, 8, 13)
    return ag, rs, ar, a2a

  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=(P("x"),) * 4))
  rng = np.random.default_rng(0)
  args = [jax.device_put(rng.standard_normal(s).astype(np.float32), shard)
          for s in ((24, 5), (128, 7), (8, 11), (8, 8, 13))]
  text = g.lower(*args).compile().as_text()
  got = hc.summary(hc.collectives(text))
  assert got["all-gather"] == {"count": 1, "bytes": 24 * 5 * 4}
  assert got["reduce-scatter"] == {"count": 1, "bytes": 16 * 7 * 4}
  assert got["all-to-all"]["count"] == 1 and got["all-to-all"]["bytes"] == 8 * 13 * 4
  assert got["all-reduce"] == {"count": 1, "bytes": 11 * 4}


# Async collectives as the TPU compiler prints them (hand-written in that syntax: layouts
# with tiling, tuple results holding the operand first), plus a -done half to skip.
TPU_TEXT = """
%all-gather-start.1 = (bf16[96,768]{1,0:T(8,128)(2,1)}, bf16[1536,768]{1,0:T(8,128)(2,1)}) all-gather-start(bf16[96,768]{1,0:T(8,128)(2,1)} %fusion.3), channel_id=1, replica_groups=[1,16]<=[16], dimensions={0}
%all-gather-done.1 = bf16[1536,768]{1,0:T(8,128)(2,1)} all-gather-done((bf16[96,768]{1,0}, bf16[1536,768]{1,0}) %all-gather-start.1)
%all-reduce-start.2 = f32[4096,48]{1,0:T(8,128)} all-reduce-start(f32[4096,48]{1,0:T(8,128)} %g.7), channel_id=2, to_apply=%add
%all-reduce-done.2 = f32[4096,48]{1,0} all-reduce-done(f32[4096,48]{1,0} %all-reduce-start.2)
%reduce-scatter.9 = f32[2,1024,4096]{2,1,0} reduce-scatter(f32[2,1024,8192]{2,1,0} %sim), channel_id=3, dimensions={2}, to_apply=%add
ROOT %collective-permute-start.4 = (s32[8,32]{1,0}, s32[8,32]{1,0}, u32[], u32[]) collective-permute-start(s32[8,32]{1,0} %idx), source_target_pairs={{0,1},{1,0}}
"""


def test_collectives_of_tpu_style_async_text():
  ops = hc.collectives(TPU_TEXT)
  assert [op.kind for op in ops] == ["all-gather", "all-reduce", "reduce-scatter",
                                     "collective-permute"]
  s = hc.summary(ops)
  assert s["all-gather"] == {"count": 1, "bytes": 1536 * 768 * 2}  # output, not the tuple
  assert s["all-reduce"] == {"count": 1, "bytes": 4096 * 48 * 4}
  assert s["reduce-scatter"] == {"count": 1, "bytes": 2 * 1024 * 8192 * 4}  # its input
  assert s["collective-permute"] == {"count": 1, "bytes": 8 * 32 * 4}
  assert ops[3].results == ((8, 32),)
  k = 8192
  protos = {k, k // 2}
  # the bank's gradient (4096, 48) has K/2 but no tokens; the (2, 1024, 8192) one has both
  assert [op.kind for op in hc.with_proto_dim(ops, protos)] == ["all-reduce",
                                                                 "reduce-scatter"]
  assert [op.kind for op in hc.moves_tokens_by_protos(ops, protos, 1024, 768)] == [
      "reduce-scatter"]
  bank = hc.Collective("all-reduce", ((4096, 1024),), ((4096, 1024),), 0)
  assert hc.moves_tokens_by_protos([bank], protos, 1024, 1024) == []  # (K/2, D), D = T
  # attention's (heads, tokens, Dh) with 8 x 1024 tokens = K: one axis, not N x K
  attn = hc.Collective("all-to-all", ((12, 8192, 64),), ((12, 8192, 64),), 0)
  assert hc.moves_tokens_by_protos([attn], protos, 1024, 768) == []
  flat = hc.Collective("all-gather", ((16384, 4096),), ((16384, 8192),), 0)  # (N, K)
  assert hc.moves_tokens_by_protos([flat], protos, 1024, 768) == [flat]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_largest_fitting_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  for _ in range(40):
    limit = 1000.0
    fixed, per_row = rng.uniform(50, 900), rng.uniform(0.5, 200)
    curve = rng.uniform(0, 0.02)  # a little superlinear: the guess can be wrong
    calls = []

    def probe(b):
      calls.append(b)
      peak = fixed + per_row * b + curve * b * b
      return peak <= limit, peak

    max_batch = int(rng.integers(1, 300))
    truth = max((b for b in range(1, max_batch + 1) if probe(b)[0]), default=None)
    calls.clear()
    start = int(2 ** rng.integers(0, 6))
    exact = scale_table.largest_fitting(probe, limit, start, max_batch, 0.0)
    assert exact == truth
    assert len(calls) <= 2 * math.log2(max_batch + 2) + 4
    coarse = scale_table.largest_fitting(probe, limit, start, max_batch, 0.25)
    if truth is None:
      assert coarse is None
    else:
      assert probe(coarse)[0] and truth - coarse <= max(1, int(0.25 * coarse))


def test_largest_fitting_without_peaks_is_doubling_and_bisection():
  calls = []

  def probe(b):  # an HBM overflow reports no peak: plain doubling and bisection
    calls.append(b)
    return b <= 37, None

  assert scale_table.largest_fitting(probe, 1.0, 1, 256, 0.0) == 37
  assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]


def test_a_refuted_affine_guess_is_followed_by_bisection():
  """The peak of `small` on v5e-16 went 14.51 -> 14.62 GiB from b 13 to 14 (XLA's schedule
  changes with b): the line through them aimed at 26. Overflows report no peak, so the
  search once walked down from 26 one batch at a time (12 probes past 14)."""
  calls = []

  measured = {1: 1.04, 2: 2.58, 10: 11.78, 13: 14.51, 14: 14.62}  # GiB, the compiles

  def probe(b):
    calls.append(b)
    peak = (np.interp(b, list(measured), list(measured.values())) if b <= 14
            else 14.62 + 3.0 * (b - 14))
    return (True, float(peak)) if peak <= 16.0 else (False, None)

  assert scale_table.largest_fitting(probe, 16.0, 1, 256, 0.25) == 14
  assert calls[:6] == [1, 2, 10, 13, 14, 26] and len(calls) <= 10, calls


def _depth_probe(peak_GiB):
  """result(b, layers) of a fake compile with peak_GiB(b, layers) (None: overflow) against
  a 16 GiB chip, and the (b, layers) it was asked for."""
  asked = []

  def result(b, layers):
    asked.append((b, layers))
    peak = peak_GiB(b, layers)
    if peak is None or peak > 16:
      return {"fits": False}
    return {"fits": True, "peak_bytes": peak * 2 ** 30}
  return result, asked


@pytest.mark.parametrize("resolution", [0.0, 0.25])
def test_search_in_depth_edges_name_what_was_compiled(resolution):
  """The search's edge cases, each reason a compile it made: nothing fits at full depth; the
  depth line is over the HBM at b 1 while the full depth fits (it compiles b 1 and searches
  up); a shallow step overflows at b 1; the deeper shallow step overflows at guess + 1."""
  limit, search = 16 * 2 ** 30, scale_table.search_in_depth
  # a full depth that never fits, under a line that says b 5
  result, asked = _depth_probe(lambda b, l: None if l == 12 else 1.0 + b * (0.2 + 0.1 * l))
  assert search(result, 12, (2, 4), limit, 1, 64, resolution) == (
      None, "b 1 overflows at full depth (compiled)")
  assert (1, 12) in asked
  # the line says 18 GiB at b 1 (steep in depth), the full depth holds 15 GiB up to b 3
  result, asked = _depth_probe(
      lambda b, l: (15.0 + 0.1 * b if b <= 3 else None) if l == 12 else 2.0 + 1.6 * l)
  batch, why = search(result, 12, (2, 4), limit, 1, 64, resolution)
  assert (batch, why) == (3, "b 4 overflows at full depth (compiled)") and (4, 12) in asked
  # the 4-block step overflows at b 1
  result, _ = _depth_probe(lambda b, l: 17.0 if l == 4 else 1.0)
  assert search(result, 12, (2, 4), limit, 1, 64, resolution) == (
      None, "b 1 overflows at 4 blocks (compiled)")
  # the 4-block step (and so the full depth) overflows from b 9 on, where the line fits
  result, asked = _depth_probe(
      lambda b, l: None if l >= 4 and b >= 9 else 1.0 + 0.05 * b * l)
  batch, why = search(result, 12, (2, 4), limit, 1, 64, resolution)
  assert batch == 8 and (8, 12) in asked
  assert why == "b 9 overflows at 4 blocks (compiled)" or (
      why == "b 9 overflows at full depth (compiled)" and (9, 12) in asked), why


def _fake_compiles(monkeypatch, fixed, per_block, per_row, per_row_block, wobble=0.0,
                   curve=0.0, ceiling=None):
  """scale_measure without libtpu: the peak of `blocks` blocks at batch b is
  fixed + per_block*blocks + b*(per_row + per_row_block*blocks) GiB, plus `wobble` +
  `curve` b² GiB at full depth only (what the depth line cannot see). `ceiling` (GiB,
  b_max) models XLA's rematerialization under memory pressure at full depth: peaks held
  under the ceiling up to b_max, past which nothing fits. Compiles are counted by
  (b, blocks)."""
  from benchmarks import scale_measure  # pylint: disable=import-outside-toplevel
  compiled = []

  def lower(topology, mesh, name, kind, remat, seq_len, b, blocks):
    return (b, blocks, remat), None, None, None

  def compile_and_read(lowered, cfg, state, devices, mesh, hbm):
    b, blocks, _ = lowered
    compiled.append((b, blocks))
    full = scale_table.preset("small").model.n_layers
    peak = fixed + per_block * blocks + b * (per_row + per_row_block * blocks)
    if blocks == full:
      peak += wobble + curve * b * b
      if ceiling is not None:
        peak = min(peak, ceiling[0] + 1e-3 * b) if b <= ceiling[1] else float("inf")
    if peak * 2 ** 30 > hbm:
      return {"fits": False}
    return dict(_measured(1e13, 1e11), peak_bytes=peak * 2 ** 30, n_layers=blocks)

  monkeypatch.setattr(scale_measure, "lower", lower)
  monkeypatch.setattr(scale_measure, "program_key", lambda lowered, t, m: f"p{lowered}")
  monkeypatch.setattr(scale_measure, "compile_and_read", compile_and_read)
  return compiled


@pytest.mark.parametrize("wobble,curve_at_line,remat", [
    (0.0, 0.0, False), (0.9, 0.0, False), (-0.7, 0.0, False), (-0.7, 0.35, False),
    (0.0, 0.0, True)])
def test_depth_extrapolated_search_then_full_depth_compiles(monkeypatch, tmp_path, wobble,
                                                            curve_at_line, remat):
  """The batch is first searched on 2- and 4-block compiles, then on 12-block compiles from
  there: below it when it overflows (the line missed `wobble`); above it when it fits, the
  first probe placed by the line's slope in b, the next ones by the compiled peaks: one
  probe past the truth when the line is exact or only offset, a few when the full depth
  grows faster than the line (`curve`) or XLA holds its peak under a ceiling (`remat`, as
  `small` with remat: 14.48 GiB at b 34, 14.06 at b 39)."""
  rng = np.random.default_rng(int(abs(wobble) * 10 + 100 * remat))
  fixed, per_block, per_row, per_row_block = (rng.uniform(0.2, 1.0), rng.uniform(0.05, 0.2),
                                              rng.uniform(0.01, 0.1), rng.uniform(0.05, 0.1))
  if curve_at_line:  # a line that reaches ~180, so the overshoot is a few batches
    fixed, per_block, per_row, per_row_block = 0.5, 0.1, 0.02, 0.005
  base = lambda b: fixed + 12 * per_block + b * (per_row + 12 * per_row_block)
  line = max(b for b in range(1, 257) if base(b) <= 16)  # where the depth line says
  curve = curve_at_line / line ** 2  # a gap that grows with b: the corrected line overshoots
  four_blocks = max(b for b in range(1, 257)
                    if fixed + 4 * per_block + b * (per_row + 4 * per_row_block) <= 16)
  ceiling = (15.0, (line + four_blocks) // 2) if remat else None
  compiled = _fake_compiles(monkeypatch, fixed, per_block, per_row, per_row_block, wobble,
                            curve, ceiling)
  cache = scale_table.Cache(str(tmp_path / "c.json"), "code.a")
  rows = scale_table.build(cache, ["v5e-16 fsdp"], ["small"], ["prism"], [False], 1024, 1,
                           256, 0.0, 0, log=lambda _: None)

  def peak(b):
    at = base(b) + wobble + curve * b * b
    if ceiling is not None:
      at = min(at, ceiling[0] + 1e-3 * b) if b <= ceiling[1] else float("inf")
    return at

  truth = max(b for b in range(1, 257) if peak(b) <= 16)
  assert truth < 256 and (not remat or truth > line + 4), (truth, line)
  assert rows[0]["per_chip_batch"] == truth
  assert rows[0]["batch_above"] == f"b {truth + 1} overflows at full depth (compiled)"
  full = [b for b, blocks in compiled if blocks == 12]
  assert full[0] == line and truth + 1 in full, (full, line, truth)
  if wobble <= 0 and not curve and not remat:  # one jump from the line to the truth
    assert full == sorted({line, truth, truth + 1}), (full, line, truth)
  else:  # overflows cost little (XLA stops at buffer assignment): count the fits
    fitting = [b for b in full if b <= truth]
    assert len(fitting) <= 5 and len(full) <= 14, (full, line, truth)
  assert len(compiled) - len(full) <= (16 if remat else 12), sorted(compiled)  # 2, 4 blocks
  # the line's peak at the batch, where the search compiled both shallow steps there
  assert rows[0]["extrapolated_peak_GiB"] == (
      pytest.approx(base(truth)) if {(truth, 2), (truth, 4)} <= set(compiled) else None)
  assert rows[0]["peak_GiB"] == pytest.approx(peak(truth))
  # a change to the code (a new code key) lowers again and compiles nothing it has
  again = scale_table.Cache(str(tmp_path / "c.json"), "code.b")
  rerun = scale_table.build(again, ["v5e-16 fsdp"], ["small"], ["prism"], [False], 1024, 1,
                            256, 0.0, 0, log=lambda _: None)
  assert rows[0]["compiled_this_run"] and not rerun[0]["compiled_this_run"]
  drop = lambda r: {k: v for k, v in r.items() if k != "compiled_this_run"}
  assert list(map(drop, rerun)) == list(map(drop, rows))
  assert again.new == 0 and len(again.index) == 2 * len(cache.index)
  cached = scale_table.Cache(str(tmp_path / "c.json"), "code.c")  # -1: compile nothing new
  assert scale_table.build(cached, ["v5e-16 fsdp"], ["small"], ["prism"], [True], 1024, 1,
                           256, 0.0, -1, log=lambda _: None) == [] and cached.new == 0
  # a coarse first guess (--resolution 0.25): the full-depth search after it is exact
  coarse = scale_table.build(scale_table.Cache(str(tmp_path / "coarse.json"), "code.a"),
                             ["v5e-16 fsdp"], ["small"], ["prism"], [False], 1024, 1, 256,
                             0.25, 0, log=lambda _: None)
  assert coarse[0]["per_chip_batch"] == truth
  assert coarse[0]["batch_above"] == f"b {truth + 1} overflows at full depth (compiled)"


def _measured(flops, nbytes, kind="prism", nxk=False, collectives=None):
  return {"fits": True, "peak_bytes": 3 * 2 ** 30, "flops": flops, "bytes_accessed": nbytes,
          "collectives": collectives or hc.summary([]), "proto_dims": [4096, 8192],
          "d_model": 768,
          "proto_collectives": [["all-reduce", [[4096, 768]], [[4096, 768]], 12582912]]
          + ([["all-gather", [[1024, 4096]], [[1024, 8192]], 33554432]] if nxk else []),
          "mesh_shape": [1, 16, 1], "chips": 16, "device_kind": "TPU v5 lite", "params": 1,
          "optimization_barriers": 0, "kind": kind}


def test_parallel_searches_share_one_cache_file(tmp_path):
  """Two searches (two Cache objects on one file) each save what they compiled; neither
  overwrites the other's entries, and a third reads both."""
  path = str(tmp_path / "shared.json")
  rng = np.random.default_rng(7)
  first, second = scale_table.Cache(path, "code.a"), scale_table.Cache(path, "code.a")
  results = {name: {"peak_GiB": float(rng.uniform(1, 16))} for name in ("p1", "p2", "p3")}

  def lower(program):
    return lambda: (program, lambda: results[program])
  assert first.get(first.key("v5e", 1), lower("p1")) == results["p1"]
  assert second.get(second.key("v5p", 2), lower("p2")) == results["p2"]
  assert first.get(first.key("v5e", 3), lower("p3")) == results["p3"]
  both = scale_table.Cache(path, "code.a")
  assert both.programs == results and both.new == 0
  assert both.peek(both.key("v5p", 2)) == results["p2"]
  assert sorted(os.listdir(tmp_path)) == ["shared.json", "shared.json.lock"]


def test_rows_roofline_mfu_and_ratio_rendered_by_reproduce(tmp_path):
  from prism_jax import flops  # pylint: disable=import-outside-toplevel
  from prism_jax.config import preset  # pylint: disable=import-outside-toplevel
  target = scale_table.TARGETS["v5e-16 fsdp"]
  chip = scale_table.CHIPS["v5e"]
  rng = np.random.default_rng(3)
  fl, nb = rng.uniform(1e13, 1e14), rng.uniform(1e10, 1e12)
  coll = {k: {"count": int(rng.integers(1, 99)), "bytes": int(rng.uniform(1e8, 2e10))}
          for k in hc.KINDS}
  prism = scale_table.row_for(target, "small", "prism", False, 1024, 4,
                              _measured(fl, nb, collectives=coll))
  t = max(fl / 197e12, nb / 819e9)  # the v5e figures, written out
  assert prism["roofline_step_ms"] == pytest.approx(1e3 * t)
  # every kind's bytes once, an all-reduce's twice, sent at half of 400 GB/s both ways
  wire = sum(c["bytes"] for c in coll.values()) + coll["all-reduce"]["bytes"]
  t_coll = wire / 200e9
  assert prism["collective_wire_GB"] == pytest.approx(wire / 1e9)
  assert prism["roofline_collective_ms"] == pytest.approx(1e3 * t_coll)
  assert prism["step_ms"] == pytest.approx(1e3 * max(t, t_coll))
  assert prism["step_ms_no_overlap"] == pytest.approx(1e3 * (t + t_coll))
  assert prism["tokens_per_s_per_chip"] == pytest.approx(4 * 1024 / max(t, t_coll))
  per_token = flops.flops_per_token(preset("small").model, 1024, preset("small").loss)["train"]
  assert prism["mfu"] == pytest.approx(per_token * 4 * 1024 / max(t, t_coll) / chip.peak_flops)
  assert prism["mfu_no_overlap"] == pytest.approx(per_token * 4 * 1024 / (t + t_coll)
                                                  / chip.peak_flops)
  assert prism["slice"] == "v5e-16" and prism["topology"] == "v5e:4x4"
  assert prism["nxk_collectives"] == []  # the bank's gradient only
  leaky = scale_table.row_for(target, "small", "prism", False, 1024, 4,
                              _measured(fl, nb, nxk=True))
  assert [op[0] for op in leaky["nxk_collectives"]] == ["all-gather"]
  dense = scale_table.row_for(target, "small", "dense", False, 1024, 8,
                              _measured(fl * 1.5, nb, "dense"))
  none = scale_table.row_for(target, "xl", "prism", True, 1024, None, None)
  ratio = scale_table.ratios([prism, dense, none])
  want = prism["tokens_per_s_per_chip"] / dense["tokens_per_s_per_chip"]
  assert len(ratio) == 1 and ratio[0]["prism_over_dense"] == pytest.approx(want)
  data = {"argv": ["x"], "commit": "abc",
          "command": "python -m benchmarks.scale_table --max_compiles=-1",
          "chips": {"v5e": {"source": "docs"}}, "rows": [prism, dense, none], "ratios": ratio}
  results = tmp_path / "results"
  results.mkdir()
  (results / "scale_table.json").write_text(json.dumps(data))
  md = "# R\n\n## Scale table\n\n<!-- scale_table:begin -->\nold\n<!-- scale_table:end -->\n"
  out = document.write_sections(md, str(results))
  assert "old" not in out and "Compiler estimates, not measurements" in out
  none_want = (prism["tokens_per_s_per_chip_no_overlap"]
               / dense["tokens_per_s_per_chip_no_overlap"])
  assert f"| {100 * want:.1f}% / {100 * none_want:.1f}% |" in out and "none fits" in out
  rows = document.load_rows(str(results))
  assert rows[0]["metric"].startswith("predicted PRISM/dense") and "small" in rows[0]["metric"]


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the tpu-aot extra (pip install libtpu==0.0.51)")
@pytest.mark.long  # make test-long (issue 56 item 7): a TPU compile
def test_tiny_table_with_the_k_sharded_bank(tmp_path):
  """One compile, FSDP plus the K-sharded bank (test_sharding_aot compiles FSDP alone)."""
  cache = scale_table.Cache(str(tmp_path / "cache.json"), "test")
  rows = scale_table.build(cache, ["v5p-8 fsdp+K/2"], ["tiny"], ["prism"],
                           [False], 128, 2, 2, 0.0, 0)  # one compile: 2 fits the cap
  assert [r["fits"] for r in rows] == [True]
  assert rows[0]["per_chip_batch"] == 2 and cache.new == 1
  entries = list(cache.programs.values())
  assert all(e["optimization_barriers"] == 0 and e["mosaic_calls"] > 0 for e in entries)
  r = rows[0]
  assert r["nxk_collectives"] == []  # the K-sharded bank moves no N x K matrix
  assert r["compiled_TFLOP"] > 0 and r["bytes_accessed_GB"] > 0
  assert r["collectives"]["all-gather"]["count"] > 0  # FSDP gathers weights
  assert r["mesh_shape"] == [1, 2, 2] and r["proto_collectives"]
  again = scale_table.Cache(str(tmp_path / "cache.json"), "test")
  scale_table.build(again, ["v5p-8 fsdp+K/2"], ["tiny"], ["prism"], [False], 128, 2, 2, 0.0,
                    0)
  assert again.new == 0  # resumed from the cache
