"""experiments.model_card, run in-process: the acceptance numbers of the card."""

import re

from experiments import model_card

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


def test_recipe_table_budget_and_wall_time(capsys):
  """Each GPT-2 recipe's row: tokens, steps, batch and the wall time on both slices,
  recomputed here from the recipe, the analytic FLOPs and the chips' peaks at the stated
  MFU (hours = FLOPs / (16 chips x peak x MFU))."""
  from prism_jax import config, flops  # pylint: disable=import-outside-toplevel
  model_card.main(["model_card"], mfu=0.5)
  text = capsys.readouterr().out
  assert "ASSUMED MFU of 50%" in text and "not a measurement" in text
  assert "v5e:4x4: 16 x 197 TFLOP/s" in text and "v5p-32: 16 x 459 TFLOP/s" in text
  recipe = text[text.index("Training recipes"):]
  assert "| tiny |" not in recipe
  for name in ("small", "medium", "large", "xl"):
    row = _row(recipe, name)
    cfg = config.preset(name)
    tc = cfg.train
    assert row[4] == f"{tc.steps:,}" and row[3] == "512 x 1024 = 524,288"
    tokens = tc.steps * 524_288
    assert row[2].startswith(f"{tokens / 1e9:.2f}B")
    fl = flops.flops_per_token(cfg.model, 1024, cfg.loss)
    evals = tc.steps // tc.eval_every + 1  # and the untrained model's
    total = tokens * 3 * fl["fwd"] + evals * 2 * 8 * 524_288 * fl["fwd"]
    for col, peak in ((10, 197e12), (11, 459e12)):
      want = total / (16 * peak * 0.5) / 3600
      assert abs(float(row[col]) - want) <= 0.05 + 1e-9, (name, col, row[col], want)
  small_hours = float(_row(recipe, "small")[10])
  assert 0.2 < small_hours < 0.6  # 2.6B tokens of a 131M model on 16 v5e chips at 50%
