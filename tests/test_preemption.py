"""Preemption and dead processes (CPU, tiny model).

* In-process: `install()` routes SIGTERM/SIGINT to a Preemption and restores the handlers;
  a run notified at step 3 saves step 4 and stops there.
* Two processes x 2 CPU devices through the command line: SIGTERM to process 1 only,
  between checkpoints -> both save the same step (JAX's preemption sync point) and exit 0
  with one line; the same command resumes, and the losses of all steps equal an
  uninterrupted two-process run's bit for bit. The bank is set from data at step 0, on
  both processes at once (a forward whose result every process holds).
* SIGKILL of process 1, or an exception in it -> process 0 exits non-zero with the
  runtime's error naming it, within the heartbeat timeout and a bound.

The same file is the paced launcher: `python tests/test_preemption.py paced SECONDS
<prism train flags>` runs prism train's main with a callback that sleeps
SECONDS after each step from step 2 on, so a signal lands mid-run (sleeping changes
nothing computed); with PRISM_TEST_RAISE_IN_PROCESS_1_AT=N process 1 raises at step N.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from multiprocess_env import multiprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, CKPT_EVERY = 12, 4
SETS = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.num_prototypes=16",
    "model.k=4", "model.vocab_size=258", "model.max_len=32", "data.tokenizer=byte",
    "data.seq_len=32", "train.batch_size=8", f"train.steps={STEPS}", "train.warmup_steps=2",
    "train.proto_init_step=0", f"train.ckpt_every={CKPT_EVERY}", "train.eval_every=1000",
    "train.eval_batches=1", "train.log_every=1", "data.val_fraction=0",
]
TIMEOUT_S = 600  # generous: a loaded CI box compiles slowly
RAISE_AT_ENV = "PRISM_TEST_RAISE_IN_PROCESS_1_AT"  # the paced launcher's failure step


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(cache_dir):
  return multiprocess_env(cache_dir, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
                          JAX_NUM_CPU_DEVICES="2")


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
  """A compilation cache of this file's own (multiprocess_env): the SIGTERM test's
  reference fills it, and the later runs of the same programs, both processes alike,
  read it."""
  return tmp_path_factory.mktemp("jit")


def _launch(tmp_path, cache, name, workdir, data, sets, pace=None, extra=(), env=None):
  """Two processes of prism train (paced: this file's launcher); logs in tmp_path."""
  port = _free_port()
  procs = []
  for pid in range(2):
    head = ([sys.executable, __file__, "paced", str(pace)] if pace is not None
            else [sys.executable, "-m", "prism_jax.cli", "train"])
    cmd = head + [f"--workdir={workdir}", f"--data={data}", "--distributed=on",
                  f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                  f"--process_id={pid}", *extra] + [f"--set={s}" for s in sets]
    out = open(tmp_path / f"{name}_{pid}.out", "w")
    err = open(tmp_path / f"{name}_{pid}.err", "w")
    procs.append((subprocess.Popen(cmd, cwd=REPO, env={**_env(cache), **(env or {})},
                                   stdout=out, stderr=err),
                  out, err))
  return procs


def _wait(procs, timeout=TIMEOUT_S):
  try:
    for p, _, _ in procs:
      p.wait(timeout=timeout)
  finally:
    for p, out, err in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
      out.close()
      err.close()
  return [p.returncode for p, _, _ in procs]


def _read(tmp_path, name, pid, stream):
  return (tmp_path / f"{name}_{pid}.{stream}").read_text()


def _losses(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    recs = [json.loads(l) for l in f if l.strip().endswith("}")]
  return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def _wait_for_step(workdir, step, procs, timeout=TIMEOUT_S):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if max(_losses(workdir), default=0) >= step:
      return
    if any(p.poll() is not None for p, _, _ in procs):
      raise AssertionError(f"a process ended before step {step}")
    time.sleep(0.1)
  raise AssertionError(f"step {step} not reached in {timeout} s")


def _corpus(path):
  from test_train_resume import write_corpus  # pylint: disable=import-outside-toplevel
  return write_corpus(path)


def test_install_routes_signals_and_restores_handlers():
  from prism_jax.train import preemption  # pylint: disable=import-outside-toplevel
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  with preemption.install(preemption.Preemption(multiprocess=False)) as notice:
    assert not notice.reached(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # handlers run between bytecodes of the main thread
    assert notice.reached(2) and notice.describe() == "SIGTERM"
    try:
      os.kill(os.getpid(), signal.SIGINT)  # a second SIGINT: stop at once
      time.sleep(0.05)
      raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt:
      pass
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before


def test_one_process_saves_the_step_after_the_signal(tmp_path):
  from prism_jax.cli.train import build_config  # pylint: disable=import-outside-toplevel
  from prism_jax.train import Checkpointer, preemption, train  # pylint: disable=import-outside-toplevel
  cfg = build_config("tiny", _corpus(tmp_path / "c.txt"), None, SETS)

  def signal_at_3(step, state):
    if step == 3:
      os.kill(os.getpid(), signal.SIGINT)

  with preemption.install(preemption.Preemption(multiprocess=False)) as notice:
    result = train(cfg, str(tmp_path / "run"), preemption=notice, callbacks=[signal_at_3])
  assert result.preempted and result.final_step == 4 and result.checkpoint_step == 4
  ckpt = Checkpointer(str(tmp_path / "run"))
  assert ckpt.latest_step() == 4
  ckpt.close()
  assert sorted(_losses(str(tmp_path / "run"))) == [1, 2, 3, 4]


@pytest.mark.long
def test_sigterm_to_one_of_two_processes_saves_one_step_and_resumes_exactly(tmp_path,
                                                                           jit_cache):
  data = _corpus(tmp_path / "corpus.txt")
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
  ref = _launch(tmp_path, jit_cache, "ref", ref_dir, data, SETS)  # uninterrupted, meanwhile
  # its first step compiled every program into the test's cache, which the others then read
  _wait_for_step(ref_dir, 1, ref)
  run = _launch(tmp_path, jit_cache, "run", run_dir, data, SETS, pace=0.4)
  try:
    _wait_for_step(run_dir, CKPT_EVERY + 1, run)  # past checkpoint 4, before 12
    run[1][0].send_signal(signal.SIGTERM)  # process 1 only: the notice must spread
  finally:
    codes = _wait(run)
  outs = [_read(tmp_path, "run", pid, "out") for pid in range(2)]
  errs = [_read(tmp_path, "run", pid, "err")[-3000:] for pid in range(2)]
  assert codes == [0, 0], errs
  # stdout: one preemption line per process, found wherever gloo's C++ threads put their
  # connection notes around it (they write a note in pieces, so the line may start mid-line
  # after half a note, and stray pieces of notes may stand alone): behaviour is checked
  # below (same saved step, exit 0, bit-exact resume), not the interleaving.
  lines = [re.findall(r"preempted by .*?: saved step \d+ of 12 in \S+", o) for o in outs]
  assert all(len(l) == 1 for l in lines), outs
  saved = [int(re.match(r"preempted by .*?: saved step (\d+) of 12 in ", l[0]).group(1))
           for l in lines]
  # JAX's notifier took the SIGTERM: neither process can tell which one received it
  assert lines[0] == lines[1] and lines[0][0].startswith(
      "preempted by a preemption notice (SIGTERM to one of the processes): saved step ")
  assert saved[0] == saved[1] and CKPT_EVERY < saved[0] < STEPS, saved
  step = saved[0]
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[-1] == str(step)
  assert max(_losses(run_dir)) == step
  assert "step 0: prototypes set from 256 hidden states" in _read(tmp_path, "run", 0, "err")

  resumed = _launch(tmp_path, jit_cache, "resume", run_dir, data, SETS)
  assert _wait(resumed) == [0, 0], [_read(tmp_path, "resume", p, "err")[-3000:]
                                    for p in range(2)]
  assert f"resumed from checkpoint {step}" in _read(tmp_path, "resume", 0, "err")
  assert _wait(ref) == [0, 0], [_read(tmp_path, "ref", p, "err")[-3000:] for p in range(2)]
  want, got = _losses(ref_dir), _losses(run_dir)
  assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
  for s in want:  # bit for bit: JSON keeps every bit of the float32 loss
    assert got[s] == want[s], (s, got[s], want[s])


@pytest.mark.long  # 2 x ~16 s of 2-process runs: `make test-long`
@pytest.mark.parametrize("death", ["SIGKILL", "exception"])
def test_a_dead_process_makes_the_other_exit_with_an_error(tmp_path, jit_cache, death):
  """Killed, or failed with an exception (which used to wait out jax.distributed's 300 s
  shutdown barrier and then blame process 0): process 0 exits within a bound, naming it."""
  data = _corpus(tmp_path / "corpus.txt")
  run_dir = str(tmp_path / "run")
  # SETS' programs (read from the cache); paced so that 9 s remain after step 3
  raise_at = {RAISE_AT_ENV: "3"} if death == "exception" else {}
  run = _launch(tmp_path, jit_cache, death, run_dir, data, SETS, pace=1.0,
                extra=["--heartbeat_timeout_s=5"], env=raise_at)
  try:
    if death == "SIGKILL":
      _wait_for_step(run_dir, 3, run)
      run[1][0].send_signal(signal.SIGKILL)
    else:
      run[1][0].wait(timeout=TIMEOUT_S)
    t0 = time.time()
    run[0][0].wait(timeout=90)
    elapsed = time.time() - t0
  finally:
    codes = _wait(run, timeout=5)
  err = _read(tmp_path, death, 0, "err")
  assert codes[0] != 0, (codes, err[-3000:])
  if death == "SIGKILL":
    assert codes[1] == -signal.SIGKILL, codes
  else:  # its own traceback, and no shutdown barrier
    err1 = _read(tmp_path, death, 1, "err")
    assert codes[1] == 1 and "RuntimeError: injected failure at step 3" in err1, err1[-3000:]
    assert "Shutdown barrier" not in err + err1, (err + err1)[-3000:]
  assert elapsed < 60, elapsed
  # process 0 names process 1: its posted failure (when 0's collective broke at once, on
  # CPU) or the runtime's heartbeat verdict (when 0 waited)
  posted = "error: process 1 failed: RuntimeError: injected failure at step 3"
  assert death == "exception" and posted in err or re.search(
      r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", err) or re.search(
      r"task[^\n]*\b1\b[^\n]*(heartbeat|unhealthy|died|crash)", err, re.I), err[-3000:]
  print(f"\nprocess 0 exited {codes[0]} {elapsed:.1f} s after process 1 died ({death})")


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "paced":
    pace = float(sys.argv[2])
    del sys.argv[1:3]
    from prism_jax.cli import launcher as cli  # pylint: disable=g-import-not-at-top
    from prism_jax.cli import train as launcher  # pylint: disable=g-import-not-at-top

    raise_at = int(os.environ.get(RAISE_AT_ENV, "0"))

    def slow(step, state):
      del state
      if raise_at and step >= raise_at and "--process_id=1" in sys.argv:
        raise RuntimeError(f"injected failure at step {step}")
      if step >= 2:
        time.sleep(pace)

    cli.run(lambda argv: launcher.main(argv, callbacks=[slow]))
  else:
    sys.exit(f"usage: {sys.argv[0]} paced SECONDS <prism train flags>")
