"""The architecture contracts (.importlinter, run by `make test` before pytest) hold, and a
deliberate violation makes lint-imports fail (so the check is not vacuous): among them an
import between the independent siblings analysis, control and evaluation, in either
direction (the top layer uses `|`: no permitted cycle)."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def _lint(cwd):
  return subprocess.run([LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=cwd))


def _copy_tree(dst):
  for name in ("prism_jax", "pallas_kernels", "experiments", "benchmarks", "results_md"):
    shutil.copytree(os.path.join(REPO, name), os.path.join(dst, name),
                    ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(os.path.join(REPO, ".importlinter"), dst)


def test_contracts_hold():
  res = _lint(REPO)
  assert res.returncode == 0, res.stdout[-3000:]
  assert "3 kept, 0 broken" in res.stdout, res.stdout[-3000:]


def test_each_kind_of_violation_breaks_a_contract(tmp_path):
  violations = {  # file -> an import that breaks one contract
      "pallas_kernels/topk_reconstruct/common.py": "import prism_jax.config",
      "prism_jax/model/params.py": "import prism_jax.train.metrics",
      "prism_jax/data/batch.py": "import prism_jax.model.lm",
      "prism_jax/losses.py": "import prism_jax.cli.launcher",
      "prism_jax/control/behaviour_cis.py": "import prism_jax.evaluation.scoring",
      "prism_jax/evaluation/scoring.py": "import prism_jax.control.controllers",
      "prism_jax/analysis/cards.py": "import prism_jax.evaluation.tasks",
      "prism_jax/control/sae.py": "import prism_jax.analysis.card_stats",
      "prism_jax/attribution/caching/cache.py": "import prism_jax.task_comparison",
      "benchmarks/bench_topk.py": "import experiments.reproduce",
      "results_md/serve_load.py": "import benchmarks.serve_load",
  }
  _copy_tree(tmp_path)  # one tree, one lint: every violation must be reported
  for path, line in violations.items():
    with open(tmp_path / path, "a") as f:
      f.write(f"\n{line}  # deliberate violation\n")
  res = _lint(str(tmp_path))
  assert res.returncode != 0 and "BROKEN" in res.stdout, res.stdout[-3000:]
  text = " ".join(res.stdout.split())  # import-linter wraps long lines
  for path, line in violations.items():
    source = path[:-3].replace("/", ".")
    assert f"{source} -> {line.split()[-1]}" in text, (path, res.stdout[-4000:])
