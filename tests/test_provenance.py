"""experiments/provenance.py: every results JSON records the argv and commit that wrote it,
and each recorded command still parses with its script's own flags (a dry run)."""

import glob
import json
import os
import re
import shlex
import subprocess

import pytest

from experiments import provenance_backfill
from prism_jax.cli import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "**", "*.json"),
                           recursive=True))


def test_every_results_file_records_argv_and_commit_and_its_flags_parse():
  assert RESULTS
  for path in RESULTS:
    with open(path) as f:
      recs = provenance.records(json.load(f))
    assert recs, f"{path}: no command recorded"
    for rec in recs:
      assert provenance.split_command(rec["command"])[1] == rec["argv"], path
      assert re.fullmatch(r"[0-9a-f]{40}(\+dirty\.[0-9a-f]{12})?", rec["commit"]), path
  assert provenance.check(RESULTS) == []


def test_check_refuses_an_unknown_flag_a_missing_argv_and_a_wrong_argv(tmp_path):
  good = ["--workdir=/tmp/run", "--top_m=8", "--results_json=x.json"]
  cases = {"unknown": (good + ["--bogus=1"], True), "no_argv": (good, None),
           "other_argv": (good, ["--workdir=/tmp/other"])}
  paths = {}
  for name, (args, argv) in cases.items():
    rec = {"command": "python -m experiments.cards_check " + " ".join(args), "commit": "0" * 40}
    if argv is not None:
      rec["argv"] = args if argv is True else argv
    paths[name] = str(tmp_path / f"{name}.json")
    with open(paths[name], "w") as f:
      json.dump(rec, f)
  problems = provenance.check(list(paths.values()))
  assert any(paths["unknown"] in p and "bogus" in p for p in problems), problems
  assert any(paths["no_argv"] in p and "no 'argv'" in p for p in problems), problems
  assert any(paths["other_argv"] in p and "differs" in p for p in problems), problems
  assert len(problems) == 3, problems


def test_record_is_the_argv_that_ran_and_this_checkout():
  argv = ["--workdir=/tmp/a b", "--num=3", "--nodense_only"]
  rec = provenance.record("experiments.suppress", argv)
  assert shlex.split(rec["command"]) == ["python", "-m", "experiments.suppress"] + argv
  head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=True).stdout.strip()
  assert rec["commit"].split("+")[0] == head and rec["argv"] == argv


def test_negated_bool_flags_count_as_named(tmp_path):
  # Parsed in the checker's own process: the scripts' flags stay out of this one.
  path = str(tmp_path / "neg.json")
  args = ["--workdir=/w", "--nodense_only"]
  with open(path, "w") as f:
    json.dump({"command": "python -m experiments.suppress " + " ".join(args), "argv": args,
               "commit": "0" * 40}, f)
  assert provenance.check([path]) == []


MD = """# R

## Multiple choice, sparse prototype controllers, SAE-controller baseline (issue 15)

Command:

JAX_PLATFORMS=cpu nice -n 5 .venv/bin/python -m experiments.evaluate_mc \\
    --workdir=/tmp/p --dense_workdir=/tmp/d \\
    --sae_path=/tmp/s.npz --out_json=docs/results/mc_eval.json
The SAE was trained by the same command with `--sae_steps=700` instead of `--sae_path`.
"""


def test_backfill_takes_the_command_that_ran_and_the_sae_steps_from_results_md():
  data = {"command": "python -m experiments.evaluate_mc --workdir=/tmp/p --sae_steps=1500"}
  cmd, note = provenance_backfill.FIXES["mc_eval.json"](data, MD)
  assert cmd == ("python -m experiments.evaluate_mc --workdir=/tmp/p --dense_workdir=/tmp/d "
                 "--sae_path=/tmp/s.npz --out_json=docs/results/mc_eval.json")
  assert data["sae_config"]["steps"] == 700 and "700" in note
  cards = {"workdir": "/tmp/w14/demo (trained by ...)",
           "command": "python -m experiments.cards_check --workdir=runs/demo --json=c.json"}
  cmd, _ = provenance_backfill.FIXES["cards.json"](cards, MD)
  assert cmd == "python -m experiments.cards_check --workdir=/tmp/w14/demo --json=c.json"
  with pytest.raises(ValueError, match="no section"):
    provenance_backfill.ran_command("# nothing\n", "Multiple choice", "experiments.x")
