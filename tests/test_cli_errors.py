"""Every CLI reports user errors (a missing file, a config that does not match the
checkpoint) as one `error: ...` line on stderr with a non-zero status and no traceback;
--debug shows the traceback."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--set=model.d_model=16", "--set=model.n_layers=1", "--set=model.n_heads=2",
        "--set=model.num_prototypes=16", "--set=model.k=2", "--set=model.vocab_size=258",
        "--set=data.tokenizer=byte", "--set=data.seq_len=16", "--set=model.max_len=16",
        "--set=train.batch_size=2", "--set=train.steps=2", "--set=train.proto_init_step=1",
        "--set=train.eval_every=2", "--set=train.ckpt_every=2", "--set=train.eval_batches=1"]


def run(module, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc, fragment):
  assert proc.returncode != 0, (proc.returncode, proc.stderr[-3000:])
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("module, args, fragment", [
    ("train", ["--workdir={w}", "--data={w}/missing.txt"], "missing.txt"),
    ("generate", ["--workdir={w}/none", "--prompt=x"], "none"),
    ("attribute", ["--workdir={w}/none", "--prompt=x"], "none"),
    ("demo", ["--workdir={w}/demo", "--set=data.sources={w}/missing.txt"], "missing.txt"),
])
def test_missing_inputs_are_one_line_errors(tmp_path, module, args, fragment):
  proc = run(module, *[a.format(w=tmp_path) for a in args])
  assert_one_line_error(proc, fragment)


def test_config_mismatch_is_one_line_and_debug_shows_the_traceback(tmp_path):
  text = tmp_path / "t.txt"
  text.write_text("the quick brown fox jumps over the lazy dog\n\n" * 300)
  base = [f"--workdir={tmp_path}/run", f"--data={text}"] + TINY
  first = run("train", *base)
  assert first.returncode == 0, first.stderr[-3000:]
  again = run("train", *base, "--set=model.k=3")
  assert_one_line_error(again, "model.k: checkpoint 2, requested 3")
  debug = run("train", *base, "--set=model.k=3", "--debug")
  assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_demo_config_mismatch_is_one_line(tmp_path):
  base = [f"--workdir={tmp_path}/demo", "--max_new_tokens=2", "--prompt=The"] + TINY
  first = run("demo", *base)
  assert first.returncode == 0, first.stderr[-3000:]
  again = run("demo", *base, "--set=model.k=3")
  assert_one_line_error(again, "model.k: checkpoint 2, requested 3")
  assert "to retrain the demo from scratch" in again.stderr
