"""Adds the provenance keys (argv, commit) to results JSON written before experiments record
them, from what the repository itself says, never typed in:

  python -m experiments.provenance_backfill [--results_dir=docs/results] [--results_md=...]

  argv    the recorded command's flags, except where the recorded command is known not to be
          the one that ran (FIXES): then the command that ran, from the file's own fields or
          from RESULTS.md's section of that experiment, with the wrong one kept as
          "recorded_command" and the reason in "provenance_note".
  commit  the commit that last wrote the file ("commit_kind": "committed": the run predates
          provenance recording, so it ran on code at or before that commit).

Files that already have argv and commit are left alone (re-running changes nothing).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
from prism_jax.cli import provenance

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined only when run as a script: experiments.reproduce defines the same names, and
  tests import both."""
  flags.DEFINE_string("results_dir", os.path.join(provenance.ROOT, "docs", "results"),
                      "the results JSON files (searched recursively)")
  flags.DEFINE_string("results_md", os.path.join(provenance.ROOT, "docs", "RESULTS.md"),
                      "the results document whose sections hold the commands that ran")

NOTE_COMMITTED = ("committed: the run predates provenance recording, so it ran on code at or "
                  "before this commit")


def ran_command(md: str, heading: str, module: str) -> str:
  """The `python -m module ...` command (continuation lines joined) in RESULTS.md's first
  section whose heading starts with `heading`."""
  at = re.search(r"^#+ " + re.escape(heading), md, re.M)
  if at is None:
    raise ValueError(f"RESULTS.md has no section {heading!r}")
  m = re.search(r"python -m " + re.escape(module) + r"((?:[^\n]*\\\n)*[^\n]*)", md[at.end():])
  if m is None:
    raise ValueError(f"RESULTS.md section {heading!r} has no `python -m {module}` command")
  flags_text = m.group(1).replace("\\\n", " ")
  return f"python -m {module} " + " ".join(shlex.split(flags_text))


def _fix_cards(data: dict, md: str) -> tuple[str, str]:
  """cards_check wrote a hard-coded `--workdir=runs/demo`; its own `workdir` field holds the
  run it read."""
  del md
  workdir = data["workdir"].split(" ")[0]
  args = [a if not a.startswith("--workdir=") else f"--workdir={workdir}"
          for a in provenance.split_command(data["command"])[1]]
  return (" ".join(["python", "-m", "experiments.cards_check"] + args),
          "cards_check wrote a hard-coded --workdir=runs/demo; the run it read is this file's "
          "'workdir' field")


def _fix_mc_eval(data: dict, md: str) -> tuple[str, str]:
  """evaluate_mc rebuilt its command from flag values (defaults included, e.g. --sae_steps=1500
  of an SAE loaded from --sae_path); RESULTS.md's issue-15 section has the command that ran
  and the SAE's own training steps."""
  heading = "Multiple choice, sparse prototype controllers"
  cmd = ran_command(md, heading, "experiments.evaluate_mc")
  section = md[md.index(heading):]
  steps = re.search(r"SAE was trained by the same command with `--sae_steps=(\d+)`", section)
  if steps is None:
    raise ValueError("RESULTS.md's issue-15 section does not state the SAE's training steps")
  data["sae_config"] = {"steps": int(steps.group(1)), "source": "RESULTS.md issue-15 "
                        "section: 'The SAE was trained by the same command with "
                        f"`--sae_steps={steps.group(1)}` instead of `--sae_path`'"}
  return cmd, ("evaluate_mc rebuilt its command from flag values, defaults included "
               "(--sae_steps=1500 for an SAE loaded from --sae_path and trained with "
               f"{steps.group(1)} steps); the command that ran is RESULTS.md's")


FIXES = {"cards.json": _fix_cards, "mc_eval.json": _fix_mc_eval}


def last_commit(path: str) -> str:
  out = subprocess.run(["git", "-C", provenance.ROOT, "log", "-1", "--format=%H", "--",
                        os.path.relpath(path, provenance.ROOT)], capture_output=True,
                       text=True, check=True).stdout.strip()
  if not out:
    raise ValueError(f"{path}: not committed, so no commit to record")
  return out


def backfill(path: str, md: str) -> bool:
  """Adds argv/commit to one file (True when it changed)."""
  with open(path) as f:
    text = f.read()
  data = json.loads(text)
  recs = provenance.records(data)
  if not recs or all("argv" in r and "commit" in r for r in recs):
    return False
  commit = last_commit(path)
  fix = FIXES.get(os.path.basename(path))
  if fix is not None and "recorded_command" not in data:
    cmd, note = fix(data, md)
    data["recorded_command"], data["command"] = data["command"], cmd
    data["provenance_note"] = note
    recs = provenance.records(data)
  for rec in recs:
    rec["argv"] = provenance.split_command(rec["command"])[1]
    rec["commit"], rec["commit_kind"] = commit, NOTE_COMMITTED
  # The file's own layout (indent, escapes, final newline) kept: the diff is the new keys.
  second = text.splitlines()[1] if "\n" in text else ""
  indent = (len(second) - len(second.lstrip(" "))) or None
  with open(path, "w") as f:
    json.dump(data, f, indent=indent, ensure_ascii="\\u" in text)
    f.write("\n" if text.endswith("\n") else "")
  return True


def main(argv) -> None:
  del argv
  # a missing folder would otherwise backfill nothing and say nothing
  check.existing("results_dir", FLAGS.results_dir, "folder")
  check.existing("results_md", FLAGS.results_md, "file")
  with open(FLAGS.results_md) as f:
    md = f.read()
  paths = sorted(glob.glob(os.path.join(FLAGS.results_dir, "**", "*.json"), recursive=True))
  for path in paths:
    if backfill(path, md):
      print(f"backfilled {os.path.relpath(path)}")


if __name__ == "__main__":
  define_flags()
  launcher.run(main)
