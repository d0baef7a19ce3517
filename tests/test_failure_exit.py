"""A process of a multi-process job that fails exits at once and the others name it.

Two processes of this file's worker (jax.distributed on CPU, prism_jax.cli.launcher's run),
with each path of prism_jax.distributed.exit_after_failure made to happen on purpose:

* posted: process 1 raises; once its failure is in the runtime's key-value store, process 0
  raises the error gloo gives a collective whose peer left. Process 0 prints process 1's
  failure and both exit at once (jax's graceful shutdown would hold them 300 s).
* killed: process 1 is SIGKILLed (nothing posted) and process 0 then raises that same gloo
  error: it waits for the runtime, whose heartbeat verdict names process 1.
* both: every process raises the same user error: each prints its own one line and exits
  2 (process 0, which holds the runtime's store, leaves last).
"""

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
TIMEOUT_S = 300  # start-up on a loaded box
GLOO_ERROR = ("Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection closed "
              "by peer [127.0.0.1]:1")


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("how", ["posted", "killed", "both"])
def test_a_failed_process_exits_at_once_and_the_other_names_it(tmp_path, how):
  port = _port()
  procs, logs = [], [tmp_path / f"{pid}.err" for pid in (0, 1)]
  # "killed" needs the heartbeat to name process 1; the others must finish first
  heartbeat = 5 if how == "killed" else 60
  for pid in (0, 1):
    cmd = [sys.executable, __file__, "worker", how, f"--process_id={pid}",
           "--num_processes=2", f"--coordinator_address=127.0.0.1:{port}",
           f"--heartbeat_timeout_s={heartbeat}"]
    with open(logs[pid], "w") as err:
      procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                    env=multiprocess_env(JAX_PLATFORMS="cpu",
                                                         PYTHONPATH=REPO)))
  try:
    procs[1].wait(timeout=TIMEOUT_S)  # start-up, then its failure
    t0 = time.time()
    procs[0].wait(timeout=90)
    elapsed = time.time() - t0  # process 0's exit after process 1's
  finally:
    for p in procs:
      p.kill()
      p.wait()
  err0, err1 = (log.read_text() for log in logs)
  codes = [p.returncode for p in procs]
  if how == "posted":
    assert codes == [1, 1], (codes, err0[-3000:], err1[-3000:])
    assert "RuntimeError: process 1 fails" in err1  # its own traceback
    assert "error: process 1 failed: RuntimeError: process 1 fails" in err0, err0[-3000:]
    assert elapsed < 15, elapsed  # at once, not jax's 300 s shutdown
  elif how == "both":  # a user error on every process: each its own one line, exit 2
    assert codes == [2, 2], (codes, err0[-3000:], err1[-3000:])
    for pid, err in enumerate((err0, err1)):
      assert [l for l in err.splitlines() if l.startswith("error:")] == [
          f"error: bad value in process {pid}"], err[-3000:]
    assert "Terminating process" not in err0 + err1
    assert elapsed < 15, elapsed
  else:
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, (codes, err0[-3000:])
    assert re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", err0) or \
        re.search(r"task[^\n]*\b1\b[^\n]*(heartbeat|unhealthy|died|crash)", err0, re.I), \
        err0[-3000:]
    assert elapsed < 40, elapsed  # the 5 s heartbeat, not 300 s
  assert "Shutdown barrier" not in err0 + err1


def worker(how: str) -> None:
  """Run under launcher.run as a `prism` command is."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from prism_jax import distributed  # pylint: disable=import-outside-toplevel
  from prism_jax.cli import launcher  # pylint: disable=import-outside-toplevel
  distributed.define_flags()

  def main(argv):
    del argv
    import jax  # pylint: disable=import-outside-toplevel
    distributed.initialize_from_flags()
    client = distributed._client()  # pylint: disable=protected-access
    client.wait_at_barrier("started", 60_000)
    if how == "both":
      if flags.FLAGS.process_id == 1:
        time.sleep(3)  # fails later: process 0 must wait for it
      raise ValueError(f"bad value in process {flags.FLAGS.process_id}")
    if flags.FLAGS.process_id == 1:
      if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
      raise RuntimeError("process 1 fails")
    if how == "posted":
      client.blocking_key_value_get(f"{distributed.FAILED_KEY}1", 60_000)
    raise jax.errors.JaxRuntimeError(GLOO_ERROR)

  launcher.run(main, [sys.argv[0]] + sys.argv[3:])


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(sys.argv[2])
  else:
    sys.exit(f"usage: {sys.argv[0]} worker posted|killed <distributed flags>")
