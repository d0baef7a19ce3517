"""One results writer: provenance.write_results / write_json, and no script of experiments/,
benchmarks/ or results_md/ writing JSON by hand (issue 56, item 3)."""

import ast
import json
import os

import pytest

from prism_jax.cli import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Scripts allowed their own json.dump, with the reason. Each entry must still hold one (the
# list only shrinks).
OWN_WRITER = {
    # rewrites old results files in their own indent and escaping: a backfill is a small diff
    "experiments/provenance_backfill.py",
}


def _scripts():
  for tree in ("experiments", "benchmarks", "results_md"):
    for folder, _, files in os.walk(os.path.join(ROOT, tree)):
      for name in sorted(files):
        if name.endswith(".py"):
          yield os.path.relpath(os.path.join(folder, name), ROOT)


def _json_dumps_to_files(path: str) -> list[int]:
  """Lines of `json.dump(...)` calls (to a file; json.dumps to a string is fine)."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  return [n.lineno for n in ast.walk(tree)
          if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
          and n.func.attr == "dump" and isinstance(n.func.value, ast.Name)
          and n.func.value.id == "json"]


def test_no_script_writes_json_itself():
  found = {p: lines for p in _scripts() if (lines := _json_dumps_to_files(p))}
  by_hand = {p: lines for p, lines in found.items() if p.replace(os.sep, "/") not in OWN_WRITER}
  assert not by_hand, (f"json.dump in scripts (write results with provenance.write_results, "
                       f"intermediate rows with provenance.write_json): {by_hand}")
  stale = OWN_WRITER - {p.replace(os.sep, "/") for p in found}
  assert not stale, f"no json.dump left in {sorted(stale)}: drop them from OWN_WRITER"


def test_write_results_merges_the_record_under_the_data(tmp_path, monkeypatch):
  monkeypatch.setattr("sys.argv", ["x", "--results_json=r.json"])
  path = tmp_path / "sub" / "r.json"
  provenance.write_results(str(path), {"rows": [{"metric": "μ", "ours": 1.5}], "argv": ["kept"]},
                           "experiments.lds")
  text = path.read_text(encoding="utf-8")
  data = json.loads(text)
  assert data["command"] == "python -m experiments.lds --results_json=r.json"
  assert data["argv"] == ["kept"] and data["commit"] == provenance.git_commit()
  assert "μ" in text and text.startswith('{\n "') and text.endswith("}\n")
  assert os.listdir(path.parent) == ["r.json"]  # atomic: no temp file left behind


def test_write_results_needs_a_record(tmp_path):
  with pytest.raises(ValueError, match="without a recorded command"):
    provenance.write_results(str(tmp_path / "r.json"), {"rows": [{"metric": "m"}]})
  rows = {"rows": [{"metric": "m", "command": "python -m experiments.ablate"}]}
  provenance.write_results(str(tmp_path / "r.json"), rows)  # the rows carry it
  assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8")) == rows


def test_write_json_sorts_keys_on_request_and_replaces(tmp_path):
  path = str(tmp_path / "c.json")
  provenance.write_json(path, {"b": 1, "a": {"d": 2, "c": 3}}, sort_keys=True)
  provenance.write_json(path, {"b": 1, "a": {"d": 2, "c": 3}}, sort_keys=True)
  with open(path, encoding="utf-8") as f:
    assert list(json.load(f)) == ["a", "b"]
