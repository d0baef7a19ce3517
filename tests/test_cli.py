"""The `prism` command line: `prism --help` lists every subcommand; each subcommand reports a
bad flag value and a missing input as one `error: ...` line on stderr, exit status 2, no
traceback (--debug shows it); a config that does not match the checkpoint is one line too.
And the installed packages are prism_jax and pallas_kernels only (no `experiments`)."""

import configparser
import fnmatch
import json
import os
import subprocess
import sys

import pytest

from prism_jax.cli import main as prism_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--set=model.d_model=16", "--set=model.n_layers=1", "--set=model.n_heads=2",
        "--set=model.num_prototypes=16", "--set=model.k=2", "--set=model.vocab_size=258",
        "--set=data.tokenizer=byte", "--set=data.seq_len=16", "--set=model.max_len=16",
        "--set=train.batch_size=2", "--set=train.steps=2", "--set=train.proto_init_step=1",
        "--set=train.eval_every=2", "--set=train.ckpt_every=2", "--set=train.eval_batches=1"]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)

# command -> [(argv, fragment of the one error line)]: a bad flag value, then a missing input
# ({w}: a fresh temporary directory; nothing exists under it).
CASES = {
    "train": [(["--workdir={w}/run", "--model=cnn"], "--model"),
              (["--workdir={w}/train", "--data={w}/missing.txt"], "missing.txt")],
    "generate": [(["--workdir={w}/run", "--max_new_tokens=many"], "--max_new_tokens"),
                 (["--workdir={w}/none", "--prompt=x"], "none")],
    "attribute": [(["--workdir={w}/run", "--coupling=full"], "--coupling"),
                  (["--workdir={w}/none", "--prompt=x"], "none")],
    "report": [(["--workdir={w}/run", "--prompt=x", "--top_m=some"], "--top_m"),
               (["--workdir={w}/none", "--prompt=x"], "none")],
    "cards": [(["--workdir={w}/run", "--top_m=0"], "--top_m"),
              (["--workdir={w}/none"], "none")],
    "suppress": [(["--workdir={w}/run", "--keywords_in=title"], "--keywords_in"),
                 (["--workdir={w}/none"], "none")],
    "evaluate": [(["--workdir={w}/run", "--controller=mlp"], "--controller"),
                 (["--workdir={w}/none", "--dense_workdir={w}/none2"], "none")],
    "lm-eval": [(["--workdir={w}/run", "--offline=maybe", "--", "--tasks", "t"], "--offline"),
                (["--workdir={w}/none", "--", "--tasks", "t"], "none")],
    # model-card reads no file: its "missing input" is a preset that does not exist
    "model-card": [(["--seq_len=long"], "--seq_len"), (["--config=tiny,huge"], "huge")],
    # config: a missing config file, an unknown override key
    "config": [(["--config={w}/missing.yaml"], "missing.yaml"),
               (["--set=model.dmodel=3"], "model.dmodel")],
    "import-hf": [(["--hf_dir={w}/hf", "--workdir={w}/imp", "--kind=moe"], "--kind"),
                  (["--hf_dir={w}/none", "--workdir={w}/imp"], "none")],
    "export-hf": [(["--workdir={w}/run", "--out={w}/exp", "--step=last"], "--step"),
                  (["--workdir={w}/none", "--out={w}/exp"], "none")],
    "export": [(["--workdir={w}/run", "--out={w}/exp", "--format=zip"], "--format"),
               (["--workdir={w}/none", "--out={w}/exp"], "none")],
    # serve: a bad port, a run that is not there (one line, nothing served)
    "serve": [(["--workdir={w}/run", "--port=http"], "--port"),
              (["--workdir={w}/run", "--port=70000"], "--port"),
              (["--workdir={w}/run"], "run")],
    "demo": [(["--workdir={w}/demo", "--temperature=warm"], "--temperature"),
             (["--workdir={w}/demo", "--set=data.sources={w}/missing.txt"], "missing.txt")],
}

# Runs one command's cases in one process (absl flags are process-wide: one command per
# process, its flags reset between cases); prints [(exit code, stderr), ...] as JSON.
DRIVER = """
import contextlib, io, json, sys
from absl import flags
from prism_jax.cli import main
out = []
for argv in json.loads(sys.argv[1]):
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      main.main(["prism"] + argv)
      code = 0
    except SystemExit as e:
      code = e.code
  flags.FLAGS.unparse_flags()
  out.append((code, err.getvalue()))
print("RESULTS " + json.dumps(out))
"""


def prism(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "prism_jax.cli", *args], cwd=REPO, env=ENV,
                        capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(code, stderr, fragment):
  assert code == 2, (code, stderr[-3000:])
  errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], stderr[-3000:]
  assert "Traceback" not in stderr


def test_help_lists_every_subcommand_and_an_unknown_one_is_one_line():
  res = prism("--help")
  assert res.returncode == 0, res.stderr
  listed = [line.split()[0] for line in res.stdout.split("commands:")[1].splitlines()
            if line.strip()]
  assert listed == ["train", "generate", "attribute", "report", "cards", "suppress",
                    "evaluate", "lm-eval", "model-card", "import-hf", "export-hf", "export",
                    "config", "serve", "demo"]
  res = prism("evalute")
  assert_one_line_error(res.returncode, res.stderr, "'evalute'")
  res = prism()
  assert res.returncode == 2 and "usage: prism" in res.stderr


def test_every_subcommand_reports_a_bad_flag_and_a_missing_input_in_one_line(tmp_path):
  assert set(CASES) == set(prism_main.COMMANDS)
  procs = {}
  for name, cases in CASES.items():  # one process per command, run side by side
    argvs = [[name] + [a.format(w=tmp_path) for a in argv] for argv, _ in cases]
    procs[name] = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(argvs)],
                                   cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=600)
    line = [l for l in stdout.splitlines() if l.startswith("RESULTS ")]
    assert line, (name, stderr[-3000:])
    for (code, err), (argv, fragment) in zip(json.loads(line[0][8:]), CASES[name]):
      assert_one_line_error(code, err, fragment)
  assert not os.path.exists(tmp_path / "run")  # bad flags stop before anything is written


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
  """One `prism demo` run (trains the tiny shape on the embedded corpus, then samples),
  shared by the demo and the config-mismatch tests: (its argv, the finished process)."""
  base = [f"--workdir={tmp_path_factory.mktemp('cli')}/demo", "--max_new_tokens=4",
          "--prompt=The"] + TINY
  return base, prism("demo", *base)


@pytest.mark.long  # make test-long (issue 56 item 7): the fixture runs `prism demo` end to end
def test_demo_samples_by_default_greedy_on_request_and_a_mismatch_is_one_line(demo):
  base, first = demo
  assert first.returncode == 0, first.stderr[-3000:]
  assert "sample (temperature 0.8, top-k 40, seed 0)" in first.stdout, first.stdout
  assert "distinct tokens: " in first.stdout
  greedy = prism("demo", *base, "--greedy")
  assert "sample (greedy)" in greedy.stdout, greedy.stdout
  mismatch = prism("demo", *base, "--set=model.k=3")
  assert_one_line_error(mismatch.returncode, mismatch.stderr,
                        "model.k: checkpoint 2, requested 3")
  assert "to retrain the demo from scratch" in mismatch.stderr


@pytest.mark.long  # make test-long (issue 56 item 7): on the `prism demo` fixture
def test_config_mismatch_is_one_line_and_debug_shows_the_traceback(demo):
  """`prism train` on the demo's run (the same embedded corpus, no --data) with another k."""
  base, first = demo
  assert first.returncode == 0, first.stderr[-3000:]
  again = prism("train", base[0], *TINY, "--set=model.k=3")
  assert_one_line_error(again.returncode, again.stderr, "model.k: checkpoint 2, requested 3")
  debug = prism("train", base[0], *TINY, "--set=model.k=3", "--debug")
  assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_only_the_library_and_the_kernels_are_packaged():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(REPO, "setup.cfg"))
  include = cfg["options.packages.find"]["include"].split()
  packages = []  # setuptools' find: directories with an __init__.py
  for d, dirs, files in os.walk(REPO):
    dirs[:] = [s for s in dirs if not s.startswith(".") and s != "runs"]  # .venv, .git
    if "__init__.py" in files:
      packages.append(os.path.relpath(d, REPO).replace(os.sep, "."))
  packages = [p for p in packages if any(fnmatch.fnmatchcase(p, pat) for pat in include)]
  assert "experiments" not in packages and os.path.isfile(f"{REPO}/experiments/__init__.py")
  assert "prism_jax.cli" in packages and "pallas_kernels" in packages
  assert {p.split(".")[0] for p in packages} == {"prism_jax", "pallas_kernels"}
  scripts = cfg["options.entry_points"]["console_scripts"].split("\n")
  assert "prism = prism_jax.cli.main:main" in [s.strip() for s in scripts]
