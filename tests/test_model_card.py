"""prism model-card (prism_jax/cli/model_card.py), run in-process: the acceptance numbers of the card."""

import dataclasses
import json
import re

import numpy as np
import pytest

from prism_jax.cli import model_card

GPT2_SMALL_PARAMS = 124_439_808  # GPT-2 124M: 1024 positions, LM head tied to wte


def _row(text, preset):
  line = next(l for l in text.splitlines() if l.startswith(f"| {preset} |"))
  return [c.strip() for c in line.strip("|").split("|")]


def test_model_card_prints_the_acceptance_numbers(capsys):
  model_card.main(["model_card"])
  text = capsys.readouterr().out
  small = _row(text, "small")
  dense_small = int(re.match(r"([\d,]+)", small[4]).group(1).replace(",", ""))
  assert abs(dense_small - GPT2_SMALL_PARAMS) / GPT2_SMALL_PARAMS <= 0.005
  assert dense_small == GPT2_SMALL_PARAMS  # the architecture is exactly GPT-2's
  xl = _row(text, "xl")
  overhead = float(xl[6].rstrip("%"))
  assert abs(overhead - 1.7) <= 0.1
  for preset in ("tiny", "small", "medium", "large", "xl"):
    row = _row(text, preset)
    backbone, head = (float(c.split()[0].replace(",", "")) for c in row[7:9])
    assert backbone > head > 0


def _recipe_flops(name):
  """Training + evaluation FLOPs of a recipe, written out: 3 x forward per trained token,
  and each evaluation's 8 val + 8 train batches of 512 x 1024 tokens forward only."""
  from prism_jax import config, flops  # pylint: disable=import-outside-toplevel
  cfg = config.preset(name)
  tc = cfg.train
  fwd = flops.flops_per_token(cfg.model, 1024, cfg.loss)["fwd"]
  evals = tc.steps // tc.eval_every + 1  # and the untrained model's
  return tc.steps * 524_288 * 3 * fwd + evals * 2 * 8 * 524_288 * fwd


def test_recipe_table_budget(capsys):
  """Each GPT-2 recipe's row: tokens, steps, batch and FLOPs, recomputed here."""
  from prism_jax import config  # pylint: disable=import-outside-toplevel
  model_card.main(["model_card"], scale_table=None)
  text = capsys.readouterr().out
  recipe = text[text.index("Training recipes"):]
  assert "| tiny |" not in recipe
  for name in ("small", "medium", "large", "xl"):
    row = _row(recipe, name)
    tc = config.preset(name).train
    assert row[4] == f"{tc.steps:,}" and row[3] == "512 x 1024 = 524,288"
    assert row[2].startswith(f"{tc.steps * 524_288 / 1e9:.2f}B")
    assert row[9].startswith(f"{_recipe_flops(name):.3g}")


def _scale_table(tmp_path, seed):
  """A scale table JSON of random table rows for every recipe on both slices, with the
  recipe plans derived from them (benchmarks/scale_accum.py), as scale_table.py writes."""
  from benchmarks import scale_accum, scale_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  rows = []
  for target, chips, top in (("v5e-16 fsdp", 16, 60), ("v5p-16 fsdp+K/2", 8, 220)):
    for name in ("small", "medium", "large", "xl"):
      for remat in (False, True):
        rows.append({"target": target, "slice": target.split()[0], "preset": name,
                     "kind": "prism", "remat": remat, "fits": True, "chips": chips,
                     "per_chip_batch": int(rng.integers(1, top)), "seq_len": 1024,
                     "roofline_step_ms": float(rng.uniform(100, 3000)),
                     "roofline_collective_ms": float(rng.uniform(1, 400)),
                     "analytic_TFLOP": float(rng.uniform(10, 900))})
  data = {"command": "python -m benchmarks.scale_table", "commit": "0123456789abcdef",
          "chips": {k: dataclasses.asdict(v) for k, v in scale_lib.CHIPS.items()},
          "targets": {t: {**dataclasses.asdict(scale_lib.TARGETS[t]),
                          "slice": scale_lib.TARGETS[t].slice}
                      for t in scale_lib.DEFAULT_TARGETS},
          "rows": rows, "recipes": scale_accum.recipe_rows(rows, scale_lib.CHIPS)}
  path = tmp_path / f"scale_table_{seed}.json"
  path.write_text(json.dumps(data))
  return str(path), data


def _expected(data, name, target):
  """The recipe on one slice, from the JSON's raw rows alone: for each remat setting, the
  fewest microbatches N whose rows fit; the step as the row's compute/memory time per row
  x the recipe's rows plus its collective time per microbatch (no overlap), or against it
  shrunk with the microbatch (full overlap), all raised by the PRISM prepass when N > 1;
  the higher MFU wins."""
  from prism_jax import config  # pylint: disable=import-outside-toplevel
  chip = data["targets"][target]["chip"]
  peak = {"v5e": 197e12, "v5p": 459e12}[chip]
  best = None
  for r in data["rows"]:
    if (r["target"], r["preset"]) != (target, name):
      continue
    rows = 512 // r["chips"]
    n = min(n for n in range(1, rows + 1) if rows % n == 0 and rows // n <= r["per_chip_batch"])
    m = config.preset(name).model
    d, f = m.d_model, m.mlp_ratio * m.d_model
    blocks = m.n_layers * (2 * (4 * d * d + 2 * d * f) + 4 * 1024 * d)
    head = 3 * m.num_prototypes + 2 * d * m.num_prototypes + 3 * d
    train = 3 * (blocks + 2 * d * m.vocab_size + head + 2 * m.k * d + 2 * d)
    share = (blocks + head) / train if n > 1 else 0.0
    compute = r["roofline_step_ms"] / r["per_chip_batch"] * rows * (1 + share) / 1e3
    coll = r["roofline_collective_ms"] * n * (1 + share) / 1e3  # per microbatch as at b
    useful = r["analytic_TFLOP"] * 1e12 / r["per_chip_batch"] * rows
    scaled = coll * (rows // n) / r["per_chip_batch"]  # or shrunk with the microbatch
    mfu = (useful / max(compute, scaled) / peak, useful / (compute + coll) / peak)
    if best is None or (mfu[0], -n) > (best["mfu"][0], -best["n"]):
      best = {"n": n, "micro": rows // n, "fits": r["per_chip_batch"], "remat": r["remat"],
              "mfu": mfu, "chips": r["chips"]}
  best["hours"] = [_recipe_flops(name) / (best["chips"] * peak * u) / 3600 for u in best["mfu"]]
  return best


@pytest.mark.parametrize("seed", [0, 1])
def test_hours_per_slice_from_the_scale_table(capsys, tmp_path, seed):
  """`prism model-card` prints, for each recipe on each named slice, the rows per chip that
  fit, N and the predicted MFU and hours; each checked against _expected."""
  path, data = _scale_table(tmp_path, seed)
  model_card.main(["model_card"], scale_table=path)
  text = capsys.readouterr().out
  slices = text[text.index("On TPU slices"):]
  assert "Hours:" in slices and "not measurements" in slices and "ASSUMED" not in text
  for name in ("small", "medium", "large", "xl"):
    for target, label, chips in (("v5e-16 fsdp", "v5e-16", 16),
                                 ("v5p-16 fsdp+K/2", "v5p-16", 8)):
      line = next(l for l in slices.splitlines() if l.startswith(f"| {name} | {label} |"))
      cells = [c.strip() for c in line.strip("|").split("|")]
      want = _expected(data, name, target)
      assert cells[2] == str(chips) and cells[3] == ("on" if want["remat"] else "off")
      assert cells[4:7] == [str(want["fits"]), str(want["n"]), str(want["micro"])]
      assert cells[7] == f"{100 * want['mfu'][0]:.0f}% – {100 * want['mfu'][1]:.0f}%"
      got = [float(x) for x in cells[8].split(" – ")]
      for g, w in zip(got, want["hours"]):
        assert abs(g - w) <= 0.05 + 1e-9, (name, label, got, want["hours"])


def test_an_explicit_scale_table_that_is_missing_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    model_card.main(["model_card"], scale_table=str(tmp_path / "none.json"))
