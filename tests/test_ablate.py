"""experiments.ablate on cached variant results (no training): the table, the results JSON
of the default's seeds (reproduce.py's schema), and its one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from results_md import document
from results_md.control import CAVEATS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("proto_ce_ratio", "agreement", "centred_proto_share", "r1_bar", "r2_bar",
        "residual_share", "acc_full", "acc_proto", "acc_resid")


def _ablate(*args):
  return subprocess.run([sys.executable, "-m", "experiments.ablate", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _cache(workdir, rng, names):
  """Fake finished variants: fresh random metrics in <workdir>/<name>/ablation.json."""
  out = {}
  for name in names:
    r = {"variant": name, "overrides": [], "loss": float(rng.uniform(2, 4)),
         "cpu_s": float(rng.uniform(200, 300))}
    if not name.startswith("dense"):
      r.update({k: float(rng.uniform(0.1, 1.0)) for k in KEYS}, dead_prototypes=3.0)
    os.makedirs(os.path.join(workdir, name))
    with open(os.path.join(workdir, name, "ablation.json"), "w") as f:
      json.dump(r, f)
    out[name] = r
  return out


def test_results_json_rows_per_base(tmp_path):
  rng = np.random.default_rng(11)
  names = ["dense", "dense@s1", "before+proto1", "before+proto1@s1"]
  path = str(tmp_path / "faithfulness.json")
  runs = {}
  for base in ("byte", "tiny", "byte"):  # byte written twice: its row is replaced, not added
    workdir = str(tmp_path / f"{base}{len(runs)}")
    runs[base] = _cache(workdir, rng, names)
    done = _ablate(f"--out={workdir}", f"--base={base}", f"--variants={','.join(names)}",
                   "--headline=before+proto1,before+proto1@s1", f"--results_json={path}")
    assert done.returncode == 0, done.stderr
    assert "| before+proto1@s1 |" in done.stdout
  with open(path) as f:
    rows = json.load(f)["rows"]
  assert [r["base"] for r in rows] == ["tiny", "byte"]
  assert rows[0]["claim"] == "faithfulness" and "claim" not in rows[1]
  for row in rows:
    r = runs[row["base"]]
    want = [r["before+proto1"]["loss"] / r["dense"]["loss"] - 1,  # each seed vs its own twin
            r["before+proto1@s1"]["loss"] / r["dense@s1"]["loss"] - 1]
    np.testing.assert_allclose(row["vs_dense"], want, rtol=1e-12)
    agree = " / ".join(f"{100 * r[n]['agreement']:.1f}%" for n in names[2:])
    assert f"agreement {agree}," in row["ours"]
    assert row["metrics"][1]["r2_bar"] == r["before+proto1@s1"]["r2_bar"]
    assert f"--base={row['base']}" in row["command"]
  # results_md.document reads the file as schema rows; the sweep (K 512) answers no claim any more
  # (today's default's faithfulness is prototype_defaults.json's), and each row says so.
  loaded = document.load_rows(str(tmp_path))
  assert [r["base"] for r in loaded] == ["tiny", "byte"]
  assert [r.get("claim") for r in loaded] == [None, None]
  assert all(CAVEATS["faithfulness"] in r["note"] for r in loaded)


@pytest.mark.parametrize("args,match", [
    (["--variants=before+nolever"], "unknown ['nolever']"),
    (["--variants=before@sx"], "the seed after '@s' must be an integer"),
    (["--variants=dense", "--headline=dense"], "--results_json and --headline"),
    (["--variants=dense", "--headline=before", "--results_json=x.json"],
     "--headline ['before'] not among --variants"),
])
def test_bad_flags_give_one_error_line(tmp_path, args, match):
  done = _ablate(f"--out={tmp_path}", *args)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith("error:")
  assert match in done.stderr
