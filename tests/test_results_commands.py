"""Every command docs/RESULTS.md records runs as written with today's code.

Each `python -m <module> ...` and `prism <subcommand> ...` in the file's inline code spans
and fenced code blocks (environment assignments, `nice -n N`, `time` and `taskset` before it
are allowed; a shell line is cut at `&&`, `||`, `;`, `|` and `&`, so each command of a
pipeline is checked, and comments are dropped) is dry-parsed with that module's own absl
flags by prism_jax/cli/provenance.py (one process per module, as two scripts may define the
same flag; the module is imported, nothing runs): an unknown module, a module under a name
it no longer has, or an unknown flag fails. `python -m pytest ...` names test files (and
test functions) that exist. A command outside code is refused, so none escapes the check.
docs/history/ is exempt: its commands are recorded as they ran then.
"""

import glob
import os
import re
import shlex

import pytest

from prism_jax.cli import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_MD = os.path.join(ROOT, "docs", "RESULTS.md")
# Words a command may follow on its line: VAR=value, nice -n N, time, taskset -c N, timeout N.
_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*|nice|-n|-c|-?\d+|time|/usr/bin/time|taskset"
                     r"|timeout|env")
_PYTHON = re.compile(r"(.*/)?python[0-9.]*")
_OPERATORS = {"&&", "||", ";", "|", "&"}


def code_parts(md: str) -> tuple[list[tuple[int, str]], str]:
  """([(line number, code text)] of every fenced block's logical line (continuations
  joined) and every inline code span, the prose with its code spans blanked)."""
  parts, prose, block, start, fenced = [], [], [], 0, False
  for n, line in enumerate(md.splitlines(), 1):
    if line.lstrip().startswith("```"):
      fenced = not fenced
      prose.append("")
      continue
    if fenced:
      block.append(line)
      if not line.rstrip().endswith("\\"):
        parts.append((start or n, " ".join(x.rstrip().rstrip("\\") for x in block)))
        block, start = [], 0
      elif not start:
        start = n
      prose.append("")
    else:
      prose.append(line)
  text = "\n".join(prose)
  for m in re.finditer(r"`([^`]+)`", text):
    n = text.count("\n", 0, m.start()) + 1
    parts.append((n, m.group(1).replace("\\|", "|").replace("\n", " ")))
  return sorted(parts), re.sub(r"`[^`]+`", "``", text)


def segment_command(words: list[str]) -> str | None:
  """'python -m module ...' or 'prism sub ...' of one shell command's words (its prefixes
  dropped), else None."""
  i = 0
  while i < len(words) and _PREFIX.fullmatch(words[i]):
    i += 1
  rest = words[i:]
  if len(rest) >= 3 and _PYTHON.fullmatch(rest[0]) and rest[1] == "-m":
    return shlex.join(["python", "-m"] + rest[2:])
  if len(rest) >= 2 and (rest[0] == "prism" or rest[0].endswith("/prism")):
    return shlex.join(["prism"] + rest[1:])
  return None


def commands_of(code: str) -> list[str]:
  """The `python -m` / `prism` commands of one line of shell."""
  lex = shlex.shlex(code, posix=True, punctuation_chars=True)
  lex.whitespace_split, lex.commenters = True, ""
  try:
    words = list(lex)
  except ValueError:  # unbalanced quotes: prose in a code span, not a command
    return []
  words = words[:next((i for i, w in enumerate(words) if w.startswith("#")), len(words))]
  out, seg = [], []
  for w in words + [";"]:
    if w in _OPERATORS:
      cmd = segment_command(seg)
      if cmd:
        out.append(cmd)
      seg = []
    else:
      seg.append(w)
  return out


def recorded_commands(md: str) -> list[tuple[int, str]]:
  parts, _ = code_parts(md)
  return [(n, cmd) for n, code in parts for cmd in commands_of(code)]


def commands_outside_code(md: str) -> list[str]:
  """Prose lines holding a `python -m module` or `prism <subcommand> --flag` outside code."""
  from prism_jax.cli.main import COMMANDS  # pylint: disable=import-outside-toplevel
  _, prose = code_parts(md)
  names = "|".join(map(re.escape, COMMANDS))
  pattern = re.compile(rf"\bpython[0-9.]* -m [\w.]+|(^|\s)prism ({names}) --")
  return [line for line in prose.splitlines() if pattern.search(line)]


def pytest_problems(cmd: str) -> list[str]:
  """A `python -m pytest` command's test files and functions that do not exist."""
  problems = []
  for arg in shlex.split(cmd)[3:]:
    if arg.startswith("-") or "tests/" not in arg:
      continue
    path, *nodes = arg.split("::")
    full = os.path.join(ROOT, path)
    if not any(os.path.isfile(p) for p in glob.glob(full)):
      problems.append(f"{cmd!r}: no test file {path}")
      continue
    if nodes and "*" not in path:
      with open(full) as f:
        source = f.read()
      name = nodes[-1].split("[")[0]
      if not re.search(rf"def {re.escape(name)}\(", source):
        problems.append(f"{cmd!r}: {path} has no test {name}")
  return problems


def problems_of(md: str) -> list[str]:
  cmds = recorded_commands(md)
  tests = [c for _, c in cmds if c.startswith("python -m pytest")]
  problems = [p for c in tests for p in pytest_problems(c)]
  problems += provenance.check_commands(sorted({c for _, c in cmds if c not in tests}))
  return problems


@pytest.mark.long  # ~30-45 s: `make test-long`
def test_every_results_md_command_parses_with_its_modules_flags():
  with open(RESULTS_MD) as f:
    md = f.read()
  cmds = recorded_commands(md)
  modules = {provenance.split_command(c)[0] for _, c in cmds}
  assert len(cmds) > 30 and len(modules) > 20, (len(cmds), modules)
  assert problems_of(md) == []


def test_no_command_outside_code():
  with open(RESULTS_MD) as f:
    assert commands_outside_code(f.read()) == []


MD = """# R

Run `JAX_PLATFORMS=cpu nice -n 5 .venv/bin/python -m experiments.reproduce --results_dir=d`
then `prism train --config=tiny --workdir=/w --set train.steps=3` and `prism_jax.load(...)`.

| claim | command |
|---|---|
| x | `python -m benchmarks.bench_train --config=byte --byte_steps=2 \\| tee log` |

```bash
# a comment: python -m not.this
JAX_PLATFORMS=cpu python -m experiments.lds --out=/tmp/a \\
    --subsets=4 --set=loss.lambda_proto=1 && prism cards --workdir=/w  # trailing
python -m experiments.suppress --workdir=/w
python -m benchmarks.bench_train --configs=byte
prism suppress --workdir=/w --bogus_flag=1
python -m pytest -q tests/test_reproduce.py::test_no_such_test tests/test_nofile.py
echo done; python3 -m experiments.cards_check --workdir=/w --results_json=/tmp/c.json
```

Prose naming python -m experiments.lds outside code.
"""


def test_extraction_of_spans_blocks_prefixes_and_pipelines():
  assert [c for _, c in recorded_commands(MD)] == [
      "python -m experiments.reproduce --results_dir=d",
      "prism train --config=tiny --workdir=/w --set train.steps=3",
      "python -m benchmarks.bench_train --config=byte --byte_steps=2",
      "python -m experiments.lds --out=/tmp/a --subsets=4 --set=loss.lambda_proto=1",
      "prism cards --workdir=/w",
      "python -m experiments.suppress --workdir=/w",
      "python -m benchmarks.bench_train --configs=byte",
      "prism suppress --workdir=/w --bogus_flag=1",
      "python -m pytest -q tests/test_reproduce.py::test_no_such_test tests/test_nofile.py",
      "python -m experiments.cards_check --workdir=/w --results_json=/tmp/c.json"]
  assert commands_outside_code(MD) == ["Prose naming python -m experiments.lds outside code."]


def test_an_unknown_module_a_moved_module_and_unknown_flags_fail():
  problems = problems_of(MD)
  expect = {"experiments.suppress": "ModuleNotFoundError", "--configs=byte": "configs",
            "--bogus_flag=1": "bogus_flag", "test_no_such_test": "has no test",
            "test_nofile.py": "no test file"}
  for needle, why in expect.items():
    assert any(needle in p and why in p for p in problems), (needle, problems)
  assert len(problems) == len(expect), problems


def test_today_command_is_the_recorded_command_under_todays_names():
  recorded = ("python -m experiments.suppress --workdir=/w --num=8 --json=out.json "
              "--cards=/c --nodense_only")
  assert provenance.today_command(recorded) == (
      "prism suppress --workdir=/w --num=8 --results_json=out.json --cards_dir=/c "
      "--nodense_only")
  assert provenance.today_command(
      "python -m experiments.bench_train --configs=byte --out=t.json") == (
          "python -m benchmarks.bench_train --config=byte --results_json=t.json")
  assert provenance.today_command(
      "python -m experiments.ablate --workdir=/a --out=/a/t.md --variants=dense,x+y@s1") == (
          "python -m experiments.ablate --out=/a --table_md=/a/t.md --variants=dense,x+y@s1")
  unchanged = "python -m experiments.lds --out=/tmp/x --set=model.k=4"
  assert provenance.today_command(unchanged) == unchanged
  assert provenance.check_commands([provenance.today_command(recorded)]) == []


def test_relative_links_resolve():
  """docs/RESULTS.md's images and links to files (the history, plots, screenshots) exist."""
  with open(RESULTS_MD) as f:
    md = f.read()
  targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", md) if "://" not in t]
  assert targets
  missing = [t for t in targets
             if not os.path.exists(os.path.join(ROOT, "docs", t.split("#")[0]))]
  assert missing == []
