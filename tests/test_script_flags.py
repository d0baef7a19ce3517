"""Every script of experiments/ and benchmarks/ fails early and in one line (issue 47, item 6).

(a) Each script, found by listing the two folders (a new one is covered with no line here),
    run with a flag it does not define: exit status 2, exactly one `error:` line, naming
    the flag, no traceback, nothing written. HELPERS lists the files that are not scripts,
    each with its reason.
(b) Per script, one bad flag combination that its own check refuses before any work: one
    `error:` line naming the flag, and nothing written to its folder (a fresh directory
    that is also the working directory, so a relative default path counts too).

Every command runs once, up front, each in a process of its own (two scripts may define the
same flag name), forked from one process that imported jax, flax and the launcher's error
path first (otherwise ~2.5 CPU-s of imports per command, 70 commands): the child runs the
script as `python -m` does (runpy, __main__), in its own directory, its stdout and stderr
captured; what it sees differs from a fresh interpreter only in those modules being loaded.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("experiments", "benchmarks")
UNKNOWN = "no_such_flag_for_this_test"

# Files of the two folders that are not scripts: each with why it is not run.
HELPERS = {
    "experiments/hessian_sweep.py": "library of experiments/hessian.py (no flags)",
    "experiments/lds_recipe.py": "the LDS model's pinned recipe (no flags)",
    "experiments/prototype_measure.py": "measuring a run on one val half (no flags)",
    "benchmarks/configs.py": "the benchmark configs table (no flags)",
    "benchmarks/kernel_bench_lib.py": "library half of benchmarks/bench_kernels.py",
    "benchmarks/side_by_side.py": "fresh clones and pytest's summary for demo_time, suite_time",
    "benchmarks/hlo_collectives.py": "library of the scale table (collectives from HLO)",
    "benchmarks/scale_accum.py": "library of the scale table (gradient accumulation)",
    "benchmarks/scale_lib.py": "library of benchmarks/scale_table.py",
    "benchmarks/scale_measure.py": "library of the scale table (one AOT compile)",
    "benchmarks/scale_roofline.py": "library of the scale table (roofline terms)",
    "benchmarks/device_check.sh": "shell script for a lent GPU; its commands are scripts here",
    "benchmarks/tiny_default_time.sh": "shell script timing `prism demo` twice (minutes)",
}

# One refused combination per script whose own check refuses it: (module, args, what the
# error line says). "{tmp}" is the case's fresh directory.
BAD = [
    ("experiments.ablate", ["--out={tmp}/out", "--steps=0"], "--steps=0"),
    ("experiments.bank_capacity", ["--root={tmp}/r", "--seeds=0,x"], "--seeds: 'x'"),
    ("experiments.cache_multihost", ["--workdir={tmp}", "--out={tmp}/o", "--stat_shards=1"],
     "--stat_shards=1"),
    ("experiments.cards_check", ["--workdir={tmp}/run", "--top_m=0"], "--top_m=0"),
    ("experiments.default_choice", ["--root={tmp}/r", "--old=512"], "--old entry '512'"),
    ("experiments.hessian", ["--results_json={tmp}/b.json"],
     "--results_json: only with --workdir"),
    ("experiments.lds", ["--out={tmp}/o", "--alpha=1.5"], "--alpha=1.5"),
    ("experiments.planted_corpus", ["--out={tmp}/o", "--num_docs=0"], "--num_docs=0"),
    ("experiments.planted_corpus", [], "--out"),  # mark_flag_as_required, one line too
    ("experiments.provenance_backfill", ["--results_dir={tmp}/none"], "--results_dir="),
    ("experiments.rehearsal", ["--out={tmp}/o", "--batch=6"], "--batch=6"),
    ("experiments.repeat_test", ["--test=tests/no_such_file.py::t", "--times=1"], "--test="),
    ("experiments.retrofit", ["--root={tmp}/r", "--runs=dense,scratch",
                              "--results_json={tmp}/r.json"], "--results_json needs --runs"),
    ("experiments.size_trend", ["--root={tmp}/r", "--setting=2048"], "--setting entry"),
    ("experiments.suppress_heldout", ["--workdir={tmp}/run", "--nums=16,0"], "--nums: 0"),
    ("experiments.lds_costs", ["--lds_json={tmp}/lds.json", "--rounds=0"], "--rounds=0"),
    ("benchmarks.bench_attribution", ["--workdir={tmp}/run", "--sweep_ranks=16,x"],
     "--sweep_ranks: 'x'"),
    ("benchmarks.bench_checksum", ["--iters=0"], "--iters=0"),
    ("benchmarks.bench_gather_dtype", ["--shapes=small,huge"], "--shapes: unknown ['huge']"),
    ("benchmarks.bench_generate", ["--prompt_len=100", "--new_tokens=100"], "--prompt_len=100"),
    ("benchmarks.bench_kernels", ["--dtypes=float16"], "--dtypes: unknown ['float16']"),
    ("benchmarks.bench_layer_backward", ["--layer_shapes=huge"], "--layer_shapes: unknown"),
    ("benchmarks.bench_pack", ["--out={tmp}", "--corpus_dir={tmp}/corpus"], "--out="),
    ("benchmarks.bench_topk", ["--groups=8,0"], "--groups: 0"),
    ("benchmarks.bench_train", ["--warmup=-1"], "--warmup must be >= 0"),
    ("benchmarks.cache_scale", ["--out={tmp}/o", "--ranks=16,0"], "--ranks: 0"),
    ("benchmarks.compile_check", ["--mesh=1,-1,-1"], "--mesh needs"),
    ("benchmarks.demo_time", ["--results_json={tmp}/none/demo.json"], "--results_json="),
    ("benchmarks.suite_time", ["--results_json={tmp}/none/suite.json"], "--results_json="),
    ("benchmarks.gpu_check_sharded_layer", ["--impl=cuda"], "--impl=cuda"),
    ("benchmarks.profile_train", ["--reps=0"], "--reps=0"),
    ("benchmarks.report_check", ["--workdir={tmp}/run"], "--workdir="),
    ("benchmarks.serve_load", ["--workdir={tmp}", "--concurrency=0"], "--concurrency=0"),
    ("benchmarks.sparse_backward_drift", ["--checkpoints=1,x"], "--checkpoints: 'x'"),
    ("benchmarks.trace_train", ["--warmup=-1"], "--warmup=-1"),
]


def _files() -> list[str]:
  return sorted(f"{folder}/{name}" for folder in FOLDERS
                for name in os.listdir(os.path.join(REPO, folder))
                if name.endswith((".py", ".sh")) and not name.startswith("_"))


def _scripts() -> list[str]:
  return [f[:-3].replace("/", ".") for f in _files() if f not in HELPERS]


# Imported once before the forks: what most scripts import and what the launcher imports to
# classify an error (prism_jax.train.checkpoint). Single-threaded after these: fork is safe.
PRELOAD = ("numpy", "jax", "flax.nnx", "optax", "absl.app", "prism_jax.cli.launcher",
           "prism_jax.cli.provenance", "prism_jax.config", "prism_jax.train",
           "prism_jax.train.checkpoint")
AT_ONCE = 2  # children running at a time (2 cores)
CHILD_TIMEOUT_S = 120


def _child(module: str, args: list[str], cwd: str, log: str) -> None:
  """In a forked child: run `module` as `python -m module args` would; never returns."""
  import runpy  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  signal.alarm(CHILD_TIMEOUT_S)  # a script that works instead of failing: killed, reported
  code = 1
  try:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    sys.argv = [module] + args
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, (int, type(None))):
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=import-outside-toplevel
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def _serve() -> None:
  """The fork server: cases [module, args] as JSON on stdin; per case {code, output, left}
  as JSON on stdout. "{tmp}" in args is the case's fresh directory (its cwd)."""
  import importlib  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  cases = json.load(sys.stdin)
  for name in PRELOAD:
    importlib.import_module(name)
  # a thread holding a lock at fork time would deadlock the child: no fork then
  assert threading.active_count() == 1, f"threads after PRELOAD: {threading.enumerate()}"
  logs = tempfile.mkdtemp(prefix="script_flags_logs_")
  running, results = {}, [None] * len(cases)

  def reap():
    pid, status = os.wait()
    i, tmp, log = running.pop(pid)
    with open(log, errors="replace") as f:
      results[i] = {"code": os.waitstatus_to_exitcode(status), "output": f.read(),
                    "left": sorted(os.listdir(tmp))}
    shutil.rmtree(tmp)

  for i, (module, args) in enumerate(cases):
    while len(running) >= AT_ONCE:
      reap()
    tmp = tempfile.mkdtemp(prefix="script_flags_")
    log = os.path.join(logs, f"{i}.log")
    pid = os.fork()
    if pid == 0:
      _child(module, [a.format(tmp=tmp) for a in args], tmp, log)
    running[pid] = (i, tmp, log)
  while running:
    reap()
  shutil.rmtree(logs)
  json.dump(results, sys.stdout)


@pytest.fixture(scope="module")
def runs() -> dict:
  """Every command of this file, run once: (module, args tuple) -> its result."""
  cases = [(m, (f"--{UNKNOWN}=1",)) for m in _scripts()] + [(m, tuple(a)) for m, a, _ in BAD]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  done = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(cases),
                        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return dict(zip(cases, json.loads(done.stdout)))


def _one_error_line(result: dict) -> str:
  out = result["output"]
  errors = [line for line in out.splitlines() if line.startswith("error:")]
  assert result["code"] == 2 and len(errors) == 1, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  assert not result["left"], f"files written before the error: {result['left']}"
  return errors[0]


def test_every_file_is_a_script_or_a_listed_helper():
  files = _files()
  assert not set(HELPERS) - set(files), f"HELPERS lists files that are gone: " \
      f"{sorted(set(HELPERS) - set(files))}"
  for path in HELPERS:  # a file with a main is a script: run it, don't list it
    if path.endswith(".py"):
      with open(os.path.join(REPO, path), encoding="utf-8") as f:
        assert '__name__ == "__main__"' not in f.read(), f"{path} is a script"
  bad_modules = {m for m, _, _ in BAD} - set(_scripts())
  assert not bad_modules, f"BAD names modules that are not scripts: {bad_modules}"


@pytest.mark.parametrize("module", _scripts())
def test_an_unknown_flag_is_one_error_line(runs, module):
  line = _one_error_line(runs[(module, (f"--{UNKNOWN}=1",))])
  assert UNKNOWN in line, line


@pytest.mark.parametrize("module,args,says", BAD, ids=[f"{m}:{' '.join(a)}" for m, a, _ in BAD])
def test_a_bad_combination_is_one_error_line_before_any_work(runs, module, args, says):
  line = _one_error_line(runs[(module, tuple(args))])
  assert says in line, line


if __name__ == "__main__":
  _serve()
