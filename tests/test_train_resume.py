"""Resume is exact: a run SIGKILLed after checkpoint N and resumed for N more steps logs the
same per-step losses, bit for bit, as an uninterrupted run of 2N steps (CPU, 1 device).

Three processes with identical settings: (A) the CLI for 2N steps straight; (B) a script
calling `train` that parks itself after step N+2 (past checkpoint N, before N+2 is saved)
and is killed with SIGKILL once checkpoint N is complete on disk; (C) the CLI resuming B's
workdir. The prototype bank is set from data at step 2 (< N), so the restored bank, its
reset moments and the data position are all covered.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 4
SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=4", "model.vocab_size=258", "model.max_len=32", "data.tokenizer=byte",
    "data.seq_len=32", "train.batch_size=4", f"train.steps={2 * N}", "train.warmup_steps=2",
    "train.proto_init_step=2", f"train.ckpt_every={N}", "train.eval_every=1000",
    "train.eval_batches=1", "train.log_every=1", "data.val_fraction=0",
]

KILL_SCRIPT = """
import sys, time
from prism_jax.cli.train import build_config
from prism_jax.train import train
cfg = build_config("tiny", sys.argv[2], None, sys.argv[3:])
def park(step, state):
  if step == {park}:
    print("PARKED", flush=True)
    time.sleep(600)
train(cfg, sys.argv[1], callbacks=[park])
"""


def write_corpus(path, n_words=6000, seed=0):
  rng = np.random.default_rng(seed)
  words = ["prism", "token", "layer", "mixture", "proto", "data", "the", "of", "a", "and",
           "model", "jax", "sparse", "head", "loss", "step"]
  lines = [" ".join(rng.choice(words, size=12)) for _ in range(n_words // 12)]
  path.write_text("\n\n".join(lines))
  return str(path)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    recs = [json.loads(l) for l in f if l.strip()]
  return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def _cli(workdir, data, env):
  return subprocess.Popen(
      [sys.executable, "-m", "prism_jax.cli", "train", f"--workdir={workdir}", f"--data={data}"]
      + [f"--set={s}" for s in SETS], cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def _checkpoint_complete(workdir, step):
  d = os.path.join(workdir, "checkpoints", str(step))
  return os.path.isdir(d) and os.path.exists(os.path.join(d, "_CHECKPOINT_METADATA"))


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
  data = write_corpus(tmp_path / "corpus.txt")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  script = tmp_path / "killme.py"
  script.write_text(KILL_SCRIPT.format(park=N + 2))
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")

  ref = _cli(ref_dir, data, env)  # runs concurrently with the doomed run
  doomed = subprocess.Popen([sys.executable, str(script), run_dir, data] + SETS, cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
  try:
    line = doomed.stdout.readline()  # blocks until the run parks (or dies)
    assert line.strip() == "PARKED", doomed.stderr.read()[-3000:]
    deadline = time.time() + 60
    while not _checkpoint_complete(run_dir, N) and time.time() < deadline:
      time.sleep(0.2)
    assert _checkpoint_complete(run_dir, N)
    doomed.send_signal(signal.SIGKILL)
    assert doomed.wait(timeout=30) == -signal.SIGKILL
  finally:
    if doomed.poll() is None:
      doomed.kill()
  killed_losses = _losses(run_dir)
  # it really ran past the checkpoint before dying (metrics are written one step late)
  assert max(killed_losses) == N + 1

  resumed = _cli(run_dir, data, env)
  out, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err[-3000:]
  assert f"resumed from checkpoint {N}" in err
  _, ref_err = ref.communicate(timeout=300)
  assert ref.returncode == 0, ref_err[-3000:]

  want, got = _losses(ref_dir), _losses(run_dir)
  assert sorted(want) == list(range(1, 2 * N + 1))
  assert sorted(got) == sorted(want)
  for step in want:  # bit for bit: JSON keeps every bit of the float32 loss
    assert np.float32(got[step]).tobytes() == np.float32(want[step]).tobytes(), (
        step, got[step], want[step])
  # the steps the killed run did after checkpoint N were redone, with the same values
  assert killed_losses[N + 1] == want[N + 1]
