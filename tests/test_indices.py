"""Every script has a line in its folder's index: experiments/README.md, benchmarks/README.md
and prism_jax/cli/README.md (each `prism` subcommand of prism_jax/cli/main.py)."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scripts(folder: str, exts=(".py", ".sh")) -> list[str]:
  return sorted(f for f in os.listdir(os.path.join(REPO, folder))
                if f.endswith(exts) and not f.startswith("_"))


def _index(folder: str) -> str:
  with open(os.path.join(REPO, folder, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_every_experiment_and_benchmark_script_is_indexed():
  for folder in ("experiments", "benchmarks"):
    index = _index(folder)
    missing = [f for f in _scripts(folder) if not re.search(rf"\b{re.escape(f)}\b", index)]
    assert not missing, f"{folder}/README.md has no line for {missing}"


def test_every_prism_subcommand_is_indexed():
  from prism_jax.cli import main  # pylint: disable=import-outside-toplevel
  index = _index("prism_jax/cli")
  missing = [c for c in main.COMMANDS if f"`prism {c}`" not in index]
  assert not missing, f"prism_jax/cli/README.md has no row for {missing}"
