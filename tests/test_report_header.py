"""The report header's val faithfulness line: the newest val record with the decisive-token
metrics (prism_jax/analysis/report.py)."""

import json

from prism_jax.analysis.report import read_metrics, val_faithfulness_line


def test_header_line_takes_the_newest_complete_val_record(tmp_path):
  recs = [
      {"step": 0, "split": "val", "loss": 6.0, "agreement": 0.1},  # older code: no decisive
      {"step": 200, "split": "val", "agreement": 0.45, "decisive_share": 0.125,
       "agreement_decisive": 0.75},
      {"step": 300, "split": "train", "agreement": 0.9, "decisive_share": 0.9,
       "agreement_decisive": 0.9},
      {"step": 400, "split": "val", "agreement": 0.5, "decisive_share": float("nan"),
       "agreement_decisive": 0.8},
  ]
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  line = val_faithfulness_line(read_metrics(str(path)))
  assert line == ("; val (step 200): agreement 45.0%, on decisive tokens (12.5% of tokens) "
                  "75.0%")
  assert val_faithfulness_line(read_metrics(None)) == ""
