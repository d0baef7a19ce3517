"""prism model-card (prism_jax/cli/model_card.py), run in-process: the acceptance numbers of the card."""

import re

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
