"""experiments/lds_costs.py: each method costed in its own process on the model, rows
and queries of the LDS run it is given, its LDS joined from that run's JSON.

The LDS JSON here is written by the test (the fields the bench reads: argv, config, the
methods, rows), for a recipe small enough to retrain in seconds; the costs are the bench's
own measurements, checked for what they must be (a cache's build has seconds and bytes,
`random` builds nothing) rather than for values."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = ["train.steps=20", "model.num_prototypes=32"]


def _lds_json(path, sets=SETS):
  from experiments import lds_recipe  # pylint: disable=g-import-not-at-top
  cfg = json.loads(json.dumps(dataclasses.asdict(lds_recipe.config(sets)), default=list))
  data = {"command": "python -m experiments.lds", "commit": "test",
          "argv": ["--out=elsewhere", "--num_rows=48", "--queries=3", "--targets=2",
                   "--subsets=4", *[f"--set={s}" for s in sets]],
          "config": cfg, "removal": {"prism": [], "random": []},
          "rows": [{"metric": "LDS (prism)", "ours": 0.2, "ci": [0.1, 0.3]},
                   {"metric": "LDS report half (random (chosen))", "ours": 0.01,
                    "ci": [-0.1, 0.1]}]}
  with open(path, "w") as f:
    json.dump(data, f)
  return data


def _bench(tmp_path, *extra):
  return subprocess.run(
      [sys.executable, "-m", "experiments.lds_costs",
       f"--lds_json={tmp_path}/lds.json", f"--out={tmp_path}/out", *extra],
      cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
      check=False)


def test_a_recipe_other_than_the_lds_runs_is_refused_in_one_line(tmp_path):
  data = _lds_json(tmp_path / "lds.json")
  data["config"]["train"]["lr"] = 0.5
  with open(tmp_path / "lds.json", "w") as f:
    json.dump(data, f)
  proc = _bench(tmp_path)
  assert proc.returncode != 0
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "train.lr=0.5" in errors[0], proc.stderr[-2000:]
  assert not os.path.exists(tmp_path / "out" / "costs")  # refused before any method ran


@pytest.mark.long
def test_costs_split_build_from_queries_and_join_the_lds(tmp_path):
  _lds_json(tmp_path / "lds.json")
  proc = _bench(tmp_path, f"--results_json={tmp_path}/costs.json")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "costs.json") as f:
    res = json.load(f)
  costs = res["costs"]
  assert list(costs) == ["prism", "random", "(bare process)"]
  cache = costs["prism"]["builds"]["prototype cache"]
  assert cache["seconds"] > 0 and cache["bytes"] > 0
  assert costs["random"]["builds"] == {}  # nothing built: its cost is all per query
  for name in ("prism", "random"):
    assert costs[name]["num_queries"] == 3 and costs[name]["per_query_s"] > 0
  assert costs["(bare process)"]["num_rows"] == 48
  rows = {l.split(" | ")[0].lstrip("| "): l for l in res["table"].splitlines()
          if l.startswith("| ") and not l.startswith("| method")}
  assert "| 0.200 [0.100, 0.300] | – |" in rows["prism"]  # all queries; no report half
  assert "| – | 0.010 [-0.100, 0.100] |" in rows["random"]  # "(chosen)" read as the method
  assert res["command"].startswith("python -m experiments.lds_costs")
