"""The scale table's slices and recipes: Google's slice names (and a cache that survives a
rename), train.grad_accum for a recipe, the accumulated step derived from a table row
(against a derivation written out here from the model's dimensions), the one compiled
accumulated check per target (compiles faked), and the assumptions rendered under the
table."""

import importlib.util
import json
import math

import numpy as np
import pytest

from benchmarks import scale_accum
from benchmarks import scale_lib
from results_md.scale_table import scale_table_markdown
from prism_jax import config


@pytest.mark.parametrize("topology,name", [
    ("v5p:2x2x2", "v5p-16"), ("v5p:2x2x1", "v5p-8"), ("v5p:4x4x4", "v5p-128"),
    ("v5e:4x4", "v5e-16"), ("v5e:2x4", "v5e-8"), ("v5e:16x16", "v5e-256"),
    ("v4:2x2x1", "v4-8"), ("v6e:8x8", "v6e-64")])
def test_slice_names_as_google_names_them(topology, name):
  """The Cloud TPU docs' tables: v5p and v4 by TensorCores (2x2x2 = 16 cores, 8 chips),
  v5e and v6e by chips."""
  assert config.slice_name(topology) == name


def test_a_bad_topology_is_one_error_naming_it():
  with pytest.raises(ValueError, match="v5e-16"):
    config.slice_name("v5e-16")


def test_targets_are_labelled_by_slice_and_the_tracked_cache_is_keyed_by_topology():
  """The labels say the slice; the compile cache's index is keyed by topology and mesh, so
  the tracked cache's entries (made when the v5p slice was labelled "v5p-8") are the
  default targets' under their new names."""
  assert scale_lib.DEFAULT_TARGETS == ("v5e-16 fsdp", "v5p-16 fsdp+K/2")
  for name, target in scale_lib.TARGETS.items():
    assert name.split()[0] == target.slice == config.slice_name(target.topology)
  with open("benchmarks/scale_table_cache.json") as f:
    index = json.load(f)["index"]
  for name in scale_lib.DEFAULT_TARGETS:
    t = scale_lib.TARGETS[name]
    where = f"|{t.topology}|{t.mesh}|"
    assert any(where in key for key in index), where
    assert not any(name in key for key in index)  # no label in any key


def test_a_renamed_target_reads_the_same_cache(monkeypatch, tmp_path):
  """A build under another label for the same topology and mesh compiles nothing."""
  from benchmarks import scale_measure  # pylint: disable=import-outside-toplevel
  compiled = []

  def compile_and_read(lowered, *_):
    compiled.append(lowered)
    b, blocks = lowered
    peak = (1 + 0.02 * blocks * b) * 2 ** 30
    return {"fits": peak < 16 * 2 ** 30, "peak_bytes": peak, "flops": 1e12,
            "bytes_accessed": 1e10, "collectives": {}, "proto_dims": [8192], "d_model": 768,
            "proto_collectives": [], "mesh_shape": [1, 16, 1], "chips": 16,
            "device_kind": "TPU v5 lite", "params": 1, "optimization_barriers": 0}
  monkeypatch.setattr(scale_measure, "lower", lambda *a: ((a[6], a[7]), None, None, None))
  monkeypatch.setattr(scale_measure, "program_key", lambda lowered, t, m: f"p{lowered}")
  monkeypatch.setattr(scale_measure, "compile_and_read", compile_and_read)
  path = str(tmp_path / "c.json")
  first = scale_lib.build(scale_lib.Cache(path, "code.a"), ["v5e-16 fsdp"], ["small"],
                          ["prism"], [False], 1024, 1, 64, 0.0, 0, log=lambda _: None)
  old = scale_lib.TARGETS["v5e-16 fsdp"]
  renamed = scale_lib.Target("v5e-16 old label", old.topology, old.mesh, old.chip)
  monkeypatch.setitem(scale_lib.TARGETS, renamed.name, renamed)
  again = scale_lib.Cache(path, "code.a")
  second = scale_lib.build(again, [renamed.name], ["small"], ["prism"], [False], 1024, 1, 64,
                           0.0, 0, log=lambda _: None)
  assert again.new == 0 and compiled
  assert second[0]["per_chip_batch"] == first[0]["per_chip_batch"]
  assert second[0]["program"] == first[0]["program"]


def test_grad_accum_for_against_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(300):
    rows, fits = int(rng.integers(1, 200)), int(rng.integers(1, 250))
    want = min(n for n in range(1, rows + 1) if rows % n == 0 and rows / n <= fits)
    assert config.grad_accum_for(rows, fits) == want
  assert config.grad_accum_for(32, 10) == 4 and config.grad_accum_for(64, 119) == 1
  with pytest.raises(ValueError, match="must be >= 1"):
    config.grad_accum_for(32, 0)


def _prepass_share(name):
  """The prepass (a forward without the LM head) over a training step, from the model's
  dimensions: blocks' matmuls and attention, then the prototype similarity, norms and
  selection; training = 3 x the full forward (the LM head, reconstruction and residual
  added)."""
  m = config.preset(name).model
  d, t, f, k_protos = m.d_model, 1024, m.d_mlp, m.num_prototypes
  if m.arch == "llama":  # q, o: D²; k|v: 2·D·(kv heads · Dh); SwiGLU: 3·D·F
    matmul = 2 * d * d + 2 * d * m.kv_heads * m.head_dim + 3 * d * f
  else:  # qkv 3D², o D², MLP 2·D·F
    matmul = 4 * d * d + 2 * d * f
  blocks = m.n_layers * (2 * matmul + 4 * t * d)
  head = 2 * d * k_protos + 3 * d + 2 * k_protos + k_protos
  prepass = blocks + head
  train = 3 * (blocks + 2 * d * m.vocab_size + head + 2 * m.k * d + 2 * d)
  return prepass / train


def _row(rng, preset, remat, fits, chips=16, target="v5e-16 fsdp", kind="prism"):
  return {"target": target, "slice": target.split()[0], "preset": preset, "kind": kind,
          "remat": remat, "fits": True, "chips": chips, "per_chip_batch": fits,
          "seq_len": 1024, "roofline_step_ms": float(rng.uniform(100, 2000)),
          "roofline_collective_ms": float(rng.uniform(1, 300)),
          "analytic_TFLOP": float(rng.uniform(10, 500)),
          "compiled_TFLOP": float(rng.uniform(10, 600)),
          "bytes_accessed_GB": float(rng.uniform(50, 900)),
          "collective_wire_GB": float(rng.uniform(1, 30))}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_against_a_derivation_written_out(seed):
  rng = np.random.default_rng(seed)
  for name in config.RECIPES:
    for kind in ("prism", "dense"):
      fits = int(rng.integers(1, 80))
      row = _row(rng, name, bool(rng.integers(2)), fits, kind=kind)
      p = scale_accum.plan(row, scale_lib.CHIPS["v5e"])
      rows = 512 // 16
      n = min(n for n in (1, 2, 4, 8, 16, 32) if rows / n <= fits)
      share = _prepass_share(name) if kind == "prism" and n > 1 else 0.0
      assert (p["grad_accum"], p["microbatch"]) == (n, rows // n)
      assert p["prepass_share"] == pytest.approx(share, rel=1e-12)
      compute = row["roofline_step_ms"] / fits * rows * (1 + share)
      # collectives per microbatch: the row's scaled by rows (optimistic, with full
      # overlap) or unscaled (pessimistic, with none), over n microbatches
      low = row["roofline_collective_ms"] / fits * (rows // n) * n * (1 + share)
      high = row["roofline_collective_ms"] * n * (1 + share)
      assert low <= high
      assert p["step_ms"] == pytest.approx(max(compute, low))
      assert p["step_ms_no_overlap"] == pytest.approx(compute + high)
      useful = row["analytic_TFLOP"] * 1e12 / fits * rows
      assert p["mfu"] == pytest.approx(useful / (max(compute, low) / 1e3) / 197e12)
      assert p["mfu_no_overlap"] == pytest.approx(useful / ((compute + high) / 1e3) / 197e12)
      assert p["tokens_per_s_per_chip"] == pytest.approx(rows * 1024 / max(compute, low) * 1e3)


def test_recipe_rows_choose_the_remat_with_the_higher_mfu():
  rng = np.random.default_rng(5)
  rows = [_row(rng, "xl", False, 1), _row(rng, "xl", True, 10),
          _row(rng, "xl", True, 119, chips=8, target="v5p-16 fsdp+K/2"),
          _row(rng, "tiny", False, 99)]  # not a recipe
  plans = scale_accum.recipe_rows(rows, scale_lib.CHIPS)
  assert {p["preset"] for p in plans} == {"xl"}
  v5e = [p for p in plans if p["slice"] == "v5e-16"]
  assert [p["chosen"] for p in v5e] == [v5e[0]["mfu"] > v5e[1]["mfu"],
                                        v5e[1]["mfu"] >= v5e[0]["mfu"]]
  v5p = next(p for p in plans if p["slice"] == "v5p-16")
  assert v5p["chosen"] and (v5p["rows_per_chip"], v5p["grad_accum"]) == (64, 1)
  assert scale_accum.check_presets(plans, ["v5e-16 fsdp", "v5p-16 fsdp+K/2"]) == {
      "v5e-16 fsdp": "xl", "v5p-16 fsdp+K/2": "xl"}


def _fake_accumulated_compile(monkeypatch):
  from benchmarks import compile_check, scale_measure  # pylint: disable=import-outside-toplevel
  asked = []

  def lower_train_step(name, topology, mesh, rows, seq, dtype, remat, kind, impl, layers,
                       grad_accum=1):
    asked.append((name, topology, rows, remat, kind, grad_accum))
    return (name, rows, grad_accum), None, None, None

  def compile_and_read(lowered, cfg, state, devices, mesh, hbm):
    _, rows, n = lowered
    return {"fits": True, "peak_bytes": 12.5 * 2 ** 30, "flops": 3e14 / n,
            "bytes_accessed": 4e11 / n, "mosaic_calls": 4,
            "collectives": {"all-gather": {"count": 3, "bytes": 6e9},
                            "all-reduce": {"count": 1, "bytes": 1e9}}}
  monkeypatch.setattr(compile_check, "lower_train_step", lower_train_step)
  monkeypatch.setattr(scale_measure, "program_key", lambda lowered, t, m: f"p{lowered}")
  monkeypatch.setattr(scale_measure, "compile_and_read", compile_and_read)
  return asked


def test_the_accumulated_check_compiles_the_recipe_step(monkeypatch, tmp_path):
  asked = _fake_accumulated_compile(monkeypatch)
  rng = np.random.default_rng(9)
  rows = [_row(rng, "medium", True, 27),
          _row(rng, "small", False, 89, chips=8, target="v5p-16 fsdp+K/2")]
  plans = scale_accum.recipe_rows(rows, scale_lib.CHIPS)
  presets = scale_accum.check_presets(plans, ["v5e-16 fsdp", "v5p-16 fsdp+K/2"])
  assert presets == {"v5e-16 fsdp": "medium", "v5p-16 fsdp+K/2": "small"}
  cache = scale_lib.Cache(str(tmp_path / "c.json"), "code.a")
  out = scale_accum.checks(cache, rows, plans, presets, lambda: True, log=lambda _: None)
  assert asked == [("medium", "v5e:4x4", 32, True, "prism", 2),
                   ("small", "v5p:2x2x2", 64, False, "prism", 1)]
  acc, plain = out
  share = _prepass_share("medium")
  assert acc["fits"] and acc["compiled_this_run"] and acc["loop_note"]
  assert acc["derived_TFLOP"] == pytest.approx(rows[0]["compiled_TFLOP"] * 16 / 27
                                               * (1 + share))
  assert acc["derived_collective_wire_GB"] == pytest.approx(
      [rows[0]["collective_wire_GB"] * 16 / 27 * (1 + share),
       rows[0]["collective_wire_GB"] * (1 + share)])
  assert acc["collective_wire_GB"] == pytest.approx(8.0)  # 6 GB gathered + 2 x 1 GB reduced
  assert "mfu" not in acc  # a loop body counted once: no whole-step time
  assert plain["derived_TFLOP"] == pytest.approx(rows[1]["compiled_TFLOP"] * 64 / 89)
  t = max(3e14 / 459e12, 4e11 / 2765e9, 8e9 / 600e9)
  useful = rows[1]["analytic_TFLOP"] * 1e12 * 64 / 89
  assert plain["mfu"] == pytest.approx(useful / t / 459e12)
  assert plain["derived_mfu"] == next(p["mfu"] for p in plans if p["preset"] == "small")
  # the checks are cached apart from the plain probes, and a rerun compiles nothing
  assert any(k.endswith("|grad_accum=2") for k in cache.index)
  again = scale_lib.Cache(str(tmp_path / "c.json"), "code.a")
  redo = scale_accum.checks(again, rows, plans, presets, lambda: False, log=lambda _: None)
  assert again.new == 0 and not any(c["compiled_this_run"] for c in redo)
  empty = scale_lib.Cache(str(tmp_path / "d.json"), "code.a")
  skipped = scale_accum.checks(empty, rows, plans, presets, lambda: False, log=lambda _: None)
  assert all("skipped" in c for c in skipped)
  none = scale_accum.checks(empty, rows, plans, {"v5e-16 fsdp": "xl"}, lambda: True,
                            log=lambda _: None)
  assert none == [{"target": "v5e-16 fsdp", "slice": "v5e-16", "preset": "xl",
                   "skipped": "no fitting row of the table to plan from"}]
  assert "| v5e-16 | xl | | | no fitting row" in scale_table_markdown(
      {"commit": "c", "command": "x", "rows": [], "ratios": [], "accum_checks": none})


def test_render_lists_the_recipes_checks_and_assumptions(tmp_path):
  rng = np.random.default_rng(4)
  rows = [_row(rng, "medium", True, 27)]
  plans = scale_accum.recipe_rows(rows, scale_lib.CHIPS)
  data = {"commit": "0123456789abcdef", "command": "python -m benchmarks.scale_table",
          "chips": {k: {"source": v.source, "ici_bandwidth": v.ici_bandwidth,
                        "peak_flops": v.peak_flops} for k, v in scale_lib.CHIPS.items()},
          "rows": [], "ratios": [], "recipe_rows_per_step": 512, "recipes": plans,
          "fresh_rows": [], "accum_checks": [dict(
              {k: plans[0][k] for k in ("slice", "preset", "remat", "grad_accum",
                                        "microbatch")}, skipped="not compiled")]}
  md = scale_table_markdown(data)
  p = plans[0]
  assert (f"| v5e-16 | medium | prism | on | 27 | 32 | 2 | 16 | "
          f"{100 * p['prepass_share']:.0f}% |") in md
  assert "| v5e-16 | medium | on | 2 × 16 | not compiled |" in md
  assert "Compiled in this run: none" in md
  for needle in ("400 GB/s", "1200 GB/s", "Overlap.", "MFU.", "Compiler estimates",
                 "Remat.", "test_kernel_cost.py", "Accumulation", "Hours", "v5p-16"):
    assert needle in md, needle
  assert md.count("\n- **") == 10
  assert not math.isnan(p["mfu"])


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs the tpu-aot extra (pip install libtpu==0.0.51)")
@pytest.mark.long  # make test-long (issue 56 item 7): a TPU compile
def test_an_accumulated_step_compiles_for_a_tpu_slice(tmp_path):
  """The check's real path on the tiny preset: N = 2 microbatches of 2 rows a chip, the
  bank K-sharded, compiled for v5p-8 (4 chips) with libtpu's compile-only devices."""
  cache = scale_lib.Cache(str(tmp_path / "c.json"), "test")
  row = {"target": "v5p-8 fsdp+K/2", "seq_len": 128, "per_chip_batch": 2,
         "compiled_TFLOP": 1.0, "bytes_accessed_GB": 1.0, "collective_wire_GB": 1.0,
         "analytic_TFLOP": 1.0}
  plan = {"slice": "v5p-8", "target": "v5p-8 fsdp+K/2", "preset": "tiny", "kind": "prism",
          "remat": False, "rows_per_chip": 4, "grad_accum": 2, "microbatch": 2,
          "prepass_share": 0.25, "mfu": 0.5, "mfu_no_overlap": 0.4}
  got = scale_accum.check(cache, plan, row, lambda: True, log=lambda _: None)
  assert got["fits"] and got["compiled_this_run"] and cache.new == 1
  assert got["compiled_TFLOP"] > 0 and got["mosaic_calls"] > 0
  assert got["collectives"]["all-gather"]["count"] > 0  # FSDP gathers weights
