"""prism_jax/children.py: a worker ends when its parent dies, by the kernel's signal and by
the watcher thread alone (the path of platforms without PR_SET_PDEATHSIG).

Each case starts a parent process that starts a child; the child guards itself and then
sleeps for a minute; the test SIGKILLs the parent and sees the child gone within seconds.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import sys, time
    from prism_jax import children
    if sys.argv[1] == "poll":
        children._kernel_signal = lambda: False
    # pdeathsig: a watcher too slow to matter, so only the kernel's signal can end it
    poll_s = 0.1 if sys.argv[1] == "poll" else 1000.0
    print(children.die_with_parent(int(sys.argv[2]), poll_s=poll_s), flush=True)
    time.sleep(60)
""")
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())])
    print(child.pid, flush=True)
    time.sleep(60)
""")


def _gone(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return True


@pytest.mark.parametrize("how", ["pdeathsig", "poll"])
def test_a_guarded_child_ends_when_its_parent_is_sigkilled(how):
  if how == "pdeathsig" and not sys.platform.startswith("linux"):
    pytest.skip("PR_SET_PDEATHSIG is Linux's")
  env = dict(os.environ, PYTHONPATH=REPO)
  parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, how], env=env,
                            stdout=subprocess.PIPE, text=True)
  try:
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == how  # the child's guard, once in place
    assert not _gone(child)  # the guard alone ends nothing while the parent lives
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    t0 = time.time()
    while not _gone(child) and time.time() - t0 < 5:
      time.sleep(0.05)
    assert _gone(child), f"the child outlived its parent by {time.time() - t0:.1f} s"
  finally:
    parent.kill()


def test_a_child_whose_parent_is_already_gone_exits_at_once():
  from prism_jax import children  # pylint: disable=import-outside-toplevel
  code = ("import os; from prism_jax import children; "
          "children.die_with_parent(os.getppid() + 1_000_000); print('survived')")
  r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO),
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == children.EXIT_CODE and "survived" not in r.stdout
