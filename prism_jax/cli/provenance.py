"""What every results JSON records about the run that wrote it, and the check of it.

  record(module)  -> {"command", "argv", "commit"}: the command line that ran (sys.argv, not
                     flag values rebuilt from defaults) and the code commit (`+dirty` when
                     tracked files differ from it). `module` is a `python -m` module
                     (experiments.lds) or a `prism` subcommand ("prism suppress").
  write_results(path, data, module) -> the one writer of a script's results JSON: record(module)
                     merged under data (data's own keys win: a record taken at the start
                     stays), UTF-8, indent 1, atomic (paths.write_text_atomic).
  write_json(path, data) -> the same format for a script's intermediate rows and caches.
  python -m prism_jax.cli.provenance --check docs/results/x.json ...
                  -> each file's recorded command(s), parsed by the script's own absl flags
                     (a dry run: the module is imported, nothing runs): every flag named must
                     parse, and the flags the parse sets must be the ones named. One process
                     per script, as two scripts may define the same flag name.
  today_command(cmd) -> a recorded command as it is spelt today: the module under its
                     current name (MOVED; a prism_jax.cli module as its `prism` subcommand)
                     and renamed flags under today's names (for rendering recorded results).
  check_commands(cmds) -> problems of commands as written (documents: no MOVED, no renames),
                     each module's commands dry-parsed in a process of their own.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shlex
import subprocess
import sys

from absl import flags

from prism_jax import paths
from prism_jax.cli.main import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Scripts recorded under the name they had before `prism` and benchmarks/: name -> module now.
MOVED = {
    **{f"experiments.{n}": f"prism_jax.cli.{n}" for n in (
        "train", "generate", "attribute", "report", "demo", "model_card", "suppress")},
    "experiments.evaluate_mc": "prism_jax.cli.evaluate",
    **{f"experiments.{n}": f"benchmarks.{n}" for n in (
        "bench_train", "bench_kernels", "bench_topk", "bench_attribution", "bench_checksum",
        "bench_gather_dtype", "bench_generate", "bench_layer_backward", "cache_scale",
        "compile_check", "profile_train", "trace_train", "sparse_backward_drift",
        "report_check", "gpu_check_sharded_layer")},
}


def git_commit(root: str = ROOT) -> str:
  """HEAD's sha; with `+dirty.<sha256[:12] of git diff HEAD>` when tracked files differ
  from it (so two different uncommitted states never share a name); 'unknown (...)'
  outside git."""
  def git(*args):
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          check=True).stdout
  try:
    sha = git("rev-parse", "HEAD").strip()
    diff = git("diff", "HEAD")
  except (OSError, subprocess.CalledProcessError):
    return "unknown (not a git checkout)"
  if not diff:
    return sha
  return f"{sha}+dirty.{hashlib.sha256(diff.encode()).hexdigest()[:12]}"


def record(module: str, argv: list[str] | None = None) -> dict:
  """The provenance keys of a results JSON written by `python -m module` now."""
  argv = list(sys.argv[1:] if argv is None else argv)
  program = module.split() if module.startswith("prism ") else ["python", "-m", module]
  return {"command": " ".join(program + [shlex.quote(a) for a in argv]),
          "argv": argv, "commit": git_commit()}


def write_json(path, data, sort_keys: bool = False) -> None:
  """`data` as JSON at `path` (local or gs://): UTF-8 (not \\u escapes), indent 1, a final
  newline, the parent folder made; atomic, so a kill leaves the old file or the new one."""
  paths.path(path).parent.mkdir(parents=True, exist_ok=True)
  text = json.dumps(data, indent=1, ensure_ascii=False, sort_keys=sort_keys)
  paths.write_text_atomic(path, text + "\n")


def write_results(path, data: dict, module: str | None = None) -> None:
  """A script's results JSON: `record(module)` merged under `data` (a key of data wins, so a
  record taken at the start of a run stays), written by write_json. Without `module` the
  data must carry its record already (records(data): the file's or its rows')."""
  if module is not None:
    data = {**record(module), **data}
  elif not records(data):
    raise ValueError(f"{path}: results without a recorded command: pass module=")
  write_json(path, data)


def commands(data) -> list[str]:
  """Every recorded command in a results file: the top-level one and each row's."""
  return list(dict.fromkeys(r["command"] for r in records(data)))


def split_command(command: str) -> tuple[str, list[str]]:
  """('experiments.x', [flag args]) of 'python -m experiments.x --a=1 ...'; a `prism NAME`
  command gives its subcommand's module (prism_jax.cli.main.COMMANDS)."""
  words = shlex.split(command)
  if len(words) >= 2 and words[0] == "prism":
    if words[1] not in COMMANDS:
      raise ValueError(f"unknown prism command in {command!r}")
    return "prism_jax.cli." + COMMANDS[words[1]][0], words[2:]
  if len(words) < 3 or words[1] != "-m":
    raise ValueError(f"not a `python -m module ...` command: {command!r}")
  return words[2], words[3:]


def flag_names(args: list[str]) -> set[str]:
  """The flag names an argv names (--x=1, --x 1, --nox, --x)."""
  names = set()
  for a in args:
    if a.startswith("--"):
      names.add(a[2:].partition("=")[0])
  return names


def _import_script(module: str, strict: bool = False):
  """The script's module; a script moved to prism_jax/cli/ or benchmarks/ keeps its
  recorded name (MOVED) unless `strict` (a command written today must name it as it is)."""
  name = module if strict else MOVED.get(module, module)
  mod = importlib.import_module(name)
  if hasattr(mod, "define_flags") and name not in _DEFINED:  # flags defined when it runs
    mod.define_flags()
    _DEFINED.add(name)
  return mod


_DEFINED: set[str] = set()
# Flags renamed when the commands got one name per idea (--config, --results_json, --out):
# a recorded command is checked under today's names. Every script, then per script.
RENAMED_FLAGS = {"preset": "config", "presets": "config", "configs": "config",
                 "json": "results_json", "out_json": "results_json", "out_dir": "out"}
RENAMED_FLAGS_OF = {
    "experiments.ablate": {"workdir": "out", "out": "table_md"},
    "experiments.lds": {"workdir": "out"},
    "experiments.cache_scale": {"workdir": "out"},
    "experiments.suppress": {"cards": "cards_dir"},
    "experiments.bench_train": {"out": "results_json"},
}


def today_args(module: str, args: list[str]) -> list[str]:
  """A recorded argv with its renamed flags under today's names."""
  renames = dict(RENAMED_FLAGS, **RENAMED_FLAGS_OF.get(module, {}))
  out = []
  for a in args:
    if a.startswith("--"):
      name, eq, value = a[2:].partition("=")
      neg = not eq and name.startswith("no") and name[2:] in renames
      if neg:
        a = "--no" + renames[name[2:]]
      elif name in renames:
        a = "--" + renames[name] + eq + value
    out.append(a)
  return out


def dry_parse(module: str, args: list[str], strict: bool = False) -> set[str]:
  """Parse args with `module`'s absl flags in this process (imports it, runs nothing):
  the names of the flags the parse set. Raises on a flag the script does not define (and,
  `strict`, on a module recorded under a name it no longer has)."""
  _import_script(module, strict)
  fv = flags.FLAGS
  fv.unparse_flags()
  fv(["prog"] + args, known_only=False)
  return {name for name in flag_names(args)
          if (name in fv and fv[name].present)
          or (name.startswith("no") and name[2:] in fv and fv[name[2:]].present)}


def today_command(command: str) -> str:
  """A recorded command as it is written with today's code: the script under its current
  module (MOVED), a prism_jax.cli module as `prism <subcommand>`, and renamed flags under
  today's names (today_args). Only for recorded commands: a command already in today's
  spelling may be renamed again (RENAMED_FLAGS_OF keys today's names too)."""
  module, args = split_command(command)
  args, name = today_args(module, args), MOVED.get(module, module)
  sub = {f"prism_jax.cli.{mod}": cmd for cmd, (mod, _) in COMMANDS.items()}.get(name)
  program = ["prism", sub] if sub else ["python", "-m", name]
  return " ".join(program + [shlex.quote(a) for a in args])


def parse_problems(module: str, commands: list[str]) -> list[str]:
  """Problems of commands of one module as written (strict dry parse, in this process): an
  unknown module or flag, a required flag missing. A command without arguments is a name
  (`prism evaluate`): only its module must exist."""
  problems = []
  for cmd in commands:
    try:
      args = split_command(cmd)[1]
      if not args:  # a command named, not run (`prism evaluate`): the module must exist
        _import_script(module, strict=True)
        continue
      named, parsed = flag_names(args), dry_parse(module, args, strict=True)
    except Exception as e:  # pylint: disable=broad-except
      why = " ".join(str(e).split())
      problems.append(f"{cmd!r}: {module} does not parse it: {type(e).__name__}: {why}")
      continue
    if parsed != named:
      problems.append(f"{cmd!r}: flags named {sorted(named)} but parsed {sorted(parsed)}")
  return problems


def check_commands(commands: list[str]) -> list[str]:
  """Problems of `python -m module ...` / `prism <subcommand> ...` commands as written
  (a document's): each module's commands parsed in a process of its own."""
  problems, by_module = [], {}
  for cmd in commands:
    try:
      by_module.setdefault(split_command(cmd)[0], []).append(cmd)
    except ValueError as e:
      problems.append(str(e))
  for module, cmds in sorted(by_module.items()):
    r = subprocess.run([sys.executable, "-m", "prism_jax.cli.provenance", "--parse", module],
                       input=json.dumps(cmds), capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    problems += [line for line in r.stdout.splitlines() if line.strip()]
    if r.returncode not in (0, 1):
      problems.append(f"{module}: checker failed: {r.stderr.strip().splitlines()[-1:]}")
  return problems


def records(data) -> list[dict]:
  """The dicts of a results file that record a command: the file itself and/or its rows. A
  row whose command is the file's inherits the file's argv and commit."""
  if not isinstance(data, dict):
    return []
  out = [data] if "command" in data else []
  rows = data.get("rows")
  for row in rows if isinstance(rows, list) else []:
    if isinstance(row, dict) and "command" in row and row["command"] != data.get("command"):
      out.append(row)
  return out


def check_file(path: str, module: str) -> list[str]:
  """Problems of one results file whose commands run `module` (empty: it checks out)."""
  with open(path) as f:
    data = json.load(f)
  problems = []
  for rec in records(data):
    mod, args = split_command(rec["command"])
    if mod != module:
      continue
    where = f"{path} ({rec.get('metric', 'file')})"
    for key in ("argv", "commit"):
      if key not in rec:
        problems.append(f"{where}: no {key!r} recorded")
    if isinstance(rec.get("argv"), list) and rec["argv"] != args:
      problems.append(f"{where}: 'argv' {rec['argv']} differs from the command's {args}")
    try:
      args = today_args(mod, args)
      named = flag_names(args)
      parsed = dry_parse(mod, args)
    except Exception as e:  # pylint: disable=broad-except
      problems.append(f"{where}: {mod} does not parse its recorded flags: "
                      f"{type(e).__name__}: {e}")
      continue
    if parsed != named:
      problems.append(f"{where}: flags named {sorted(named)} but parsed {sorted(parsed)}")
  return problems


def modules_of(paths: list[str]) -> dict[str, list[str]]:
  """script module -> the results files whose commands run it."""
  out: dict[str, list[str]] = {}
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    cmds = commands(data)
    if not cmds:
      out.setdefault("", []).append(path)
    for cmd in cmds:
      out.setdefault(split_command(cmd)[0], []).append(path)
  return {m: list(dict.fromkeys(p)) for m, p in out.items()}


def check(paths: list[str]) -> list[str]:
  """Problems of every file; each script's flags parsed in its own process."""
  problems = []
  for module, files in sorted(modules_of(paths).items()):
    if not module:
      problems += [f"{p}: no command recorded" for p in files]
      continue
    r = subprocess.run([sys.executable, "-m", "prism_jax.cli.provenance", "--module", module]
                       + files, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    problems += [line for line in r.stdout.splitlines() if line.strip()]
    if r.returncode not in (0, 1):
      problems.append(f"{module}: checker failed: {r.stderr.strip().splitlines()[-1:]}")
  return problems


def main(argv: list[str]) -> int:
  if argv[:1] == ["--module"]:
    problems = [p for path in argv[2:] for p in check_file(path, argv[1])]
  elif argv[:1] == ["--check"]:
    problems = check(argv[1:])
  elif argv[:1] == ["--parse"] and len(argv) == 2:
    problems = parse_problems(argv[1], json.load(sys.stdin))
  else:
    print("usage: python -m prism_jax.cli.provenance --check FILE.json ...\n"
          "       python -m prism_jax.cli.provenance --parse MODULE < commands.json",
          file=sys.stderr)
    return 2
  for p in problems:
    print(p)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
