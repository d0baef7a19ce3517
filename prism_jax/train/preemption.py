"""Preemption: on SIGTERM or SIGINT the run finishes its step, saves it and stops.

The library changes no process-wide state. The command-line launcher (prism_jax/cli/train.py)
calls `install()`, a context manager that puts the signal handlers in place and restores
the previous ones on exit; it yields a `Preemption` that `train(..., preemption=p)` asks
after every step (`p.reached(step)`), saving that step and stopping when it says so.

One process: a handler sets a flag; the step after it is the one saved.

Several processes (jax.distributed) must save the same step, or the checkpoint is torn.
They agree through JAX's preemption sync point, as orbax's CheckpointManager and MaxText
use it: `jax.distributed.initialize` starts the runtime's preemption notifier, which
catches SIGTERM in any process and tells the coordination service; every process then
learns the sync step (the largest step any process has reported, plus one) and
`multihost_utils.reached_preemption_sync_point(step)` is True at that same step on all of
them. So `install()` leaves SIGTERM to that notifier (a Python handler would replace it)
and forwards SIGINT to it as a SIGTERM of this process. This works on CPU as on TPU
(tests/test_preemption.py: two CPU processes).

A second SIGINT (one process) raises KeyboardInterrupt: Ctrl-C twice stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """Whether the run should save and stop after a step (see the module docstring)."""

  def __init__(self, multiprocess: bool | None = None):
    # Several processes: only JAX's sync point is common knowledge; one: the local flag.
    self.multiprocess = (jax.distributed.is_initialized() if multiprocess is None
                         else multiprocess)
    self.signal_name: str | None = None  # the signal this process received, if any

  def notify(self, signum: int) -> None:
    """Records a preemption notice (what the installed handlers call)."""
    first = self.signal_name is None
    self.signal_name = signal.Signals(signum).name
    if self.multiprocess:
      if signum != signal.SIGTERM:  # JAX's notifier listens to SIGTERM only
        os.kill(os.getpid(), signal.SIGTERM)
    elif not first and signum == signal.SIGINT:
      raise KeyboardInterrupt

  def reached(self, step: int) -> bool:
    """True at the step to save and stop after: call once per step, on every process."""
    if self.multiprocess:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signal_name is not None

  def describe(self) -> str:
    """What stopped the run, for its last line."""
    if self.multiprocess and self.signal_name is None:  # SIGTERM went to JAX's notifier
      return "a preemption notice (SIGTERM to one of the processes)"
    return self.signal_name or "no signal"


@contextlib.contextmanager
def install(preemption: Preemption | None = None) -> Iterator[Preemption]:
  """Handlers for SIGTERM and SIGINT for the enclosed run; the previous ones restored.

  Several processes: SIGTERM stays with JAX's preemption notifier (started by
  jax.distributed.initialize, before this), SIGINT is forwarded to it. Call from the main
  thread (Python's signal rule)."""
  pre = Preemption() if preemption is None else preemption
  ours = (signal.SIGINT,) if pre.multiprocess else SIGNALS
  previous = {s: signal.getsignal(s) for s in ours}
  try:
    for s in ours:
      signal.signal(s, lambda signum, frame: pre.notify(signum))
    yield pre
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
