"""Multi-host set-up: `jax.distributed` from flags or environment, process-0 logging.

JAX multi-controller SPMD: every host runs the same command; each process sees its local
devices and all of them form one global mesh (prism_jax.sharding.make_mesh). What each
process must do differently is small and lives here or in sharding:

  * initialise the distributed runtime before anything touches a device (`initialize`);
  * read only its rows of each global batch (`sharding.process_batch_slice` gives the
    grain shard index/count; `sharding.make_global_batch` assembles the global arrays);
  * call orbax save/restore on every process (orbax coordinates; no process-0 guard);
  * log from process 0 only (`configure_logging`, `log_main`).

Resolution order for the runtime parameters: explicit arguments (flags), then environment
(PRISM_COORDINATOR_ADDRESS / PRISM_NUM_PROCESSES / PRISM_PROCESS_ID, or JAX_*), then
auto-detection by JAX on a TPU pod slice, SLURM or Open MPI; otherwise one process.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping

import jax
from absl import flags, logging
from jax._src import distributed as jax_distributed  # the runtime's client: see _client
from jax.experimental import multihost_utils

_ENV = {
    "coordinator_address": ("PRISM_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("PRISM_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("PRISM_PROCESS_ID", "JAX_PROCESS_ID"),
}
MODES = ("auto", "on", "off")
HEARTBEAT_TIMEOUT_S = 100  # jax.distributed's default


def define_flags() -> None:
  """Registers --distributed, --coordinator_address, --num_processes, --process_id."""
  if "coordinator_address" in flags.FLAGS:
    return
  flags.DEFINE_enum("distributed", "auto", MODES,
                    "auto: initialise jax.distributed when flags/env/cluster say so; on: "
                    "always (auto-detect what is not given); off: single process")
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
  flags.DEFINE_integer("num_processes", None, "total number of processes")
  flags.DEFINE_integer("process_id", None, "this process's id in [0, num_processes)")
  flags.DEFINE_integer("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S,
                       "a process silent this long is dead: the others stop with an error "
                       "naming it (jax.distributed's heartbeat), instead of waiting forever")


def detected_cluster(env: Mapping[str, str] = os.environ) -> str | None:
  """Name of a multi-process cluster JAX can auto-configure from env, else None."""
  if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
    return "slurm"
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in env:
    return "tpu"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "ompi"
  return None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, mode: str = "auto",
            env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
  """kwargs for `jax.distributed.initialize`, or None for a single process."""
  if mode not in MODES:
    raise ValueError(f"distributed mode {mode!r}; use one of {MODES}")
  if mode == "off":
    return None
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  for key, names in _ENV.items():
    if given[key] is None:
      value = next((env[n] for n in names if env.get(n)), None)
      if value is not None:
        given[key] = value if key == "coordinator_address" else int(value)
  if given["coordinator_address"] is not None:
    missing = [k for k in ("num_processes", "process_id") if given[k] is None]
    if missing and detected_cluster(env) is None:
      raise ValueError(f"coordinator_address={given['coordinator_address']!r} is set but "
                       f"{', '.join(missing)} is not (flag --{missing[0]} or env "
                       f"{_ENV[missing[0]][0]})")
  if given["num_processes"] is not None and given["process_id"] is not None:
    if not 0 <= given["process_id"] < given["num_processes"]:
      raise ValueError(f"process_id={given['process_id']} not in "
                       f"[0, num_processes={given['num_processes']})")
  kwargs = {k: v for k, v in given.items() if v is not None}
  if kwargs.get("num_processes") == 1:
    return None
  if kwargs or detected_cluster(env) is not None or mode == "on":
    return kwargs  # JAX's cluster detection fills whatever is missing
  return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, mode: str = "auto",
               initialization_timeout: int = 300,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
  """Starts the distributed runtime if needed (idempotent). Returns True if multi-process.

  Must run before the first use of a device. Also restricts logging to process 0.
  A process that dies (no heartbeat for `heartbeat_timeout_s`) makes the runtime end the
  others with an error naming it (tests/test_preemption.py). The runtime's preemption
  notifier is started too (train/preemption.py).
  """
  if heartbeat_timeout_s <= 0:
    raise ValueError(f"heartbeat_timeout_s={heartbeat_timeout_s} must be positive")
  kwargs = resolve(coordinator_address, num_processes, process_id, mode)
  if kwargs is not None and not jax.distributed.is_initialized():
    jax.distributed.initialize(initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_s, **kwargs)
  configure_logging()
  return jax.process_count() > 1


def initialize_from_flags() -> bool:
  """`initialize` with the values of the flags registered by `define_flags`."""
  f = flags.FLAGS
  return initialize(f.coordinator_address, f.num_processes, f.process_id, f.distributed,
                    heartbeat_timeout_s=f.heartbeat_timeout_s)


def is_main_process() -> bool:
  return jax.process_index() == 0


def configure_logging() -> None:
  """Process 0 logs at INFO; the others only warnings and errors."""
  if not is_main_process():
    logging.set_verbosity(logging.WARNING)


def log_main(msg: str, *args: Any) -> None:
  """absl INFO log from process 0 only."""
  if is_main_process():
    logging.info(msg, *args)


def sync(name: str) -> None:
  """Barrier across all processes (no-op on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)



FAILED_KEY = "prism_jax/failed/"  # the runtime's key-value store: who failed, and why
WAIT_FOR_PEERS_S = 10  # process 0, whose exit ends the store, waits this long for their posts
# ... and, once some posted, this long more: a process between its post and its exit when
# the store goes is aborted by the runtime (SIGABRT, not its own exit code)
EXIT_GRACE_S = 3


def _client():
  # jax has no public accessor for the runtime's client (orbax reads the same attribute)
  return jax_distributed.global_state.client


def exit_after_failure(message: str, code: int, peer_lost: bool,
                       heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> None:
  """Ends this failed process of a multi-process job at once (never returns).

  jax.distributed's graceful shutdown would wait at a barrier the others never reach (they
  wait in their next collective) for its shutdown timeout (300 s), then blame the processes
  still at work. Instead this process posts `message` in the runtime's key-value store and
  exits: its heartbeat stops, and the runtime ends those still waiting within the heartbeat
  timeout with an error naming it. Process 0 holds the store, so it first waits (at most
  WAIT_FOR_PEERS_S) for the others' posts: when all fail alike (a bad config, divergence)
  each exits with its own message, none aborted by the store's loss (process 0 leaves
  EXIT_GRACE_S after them). `peer_lost`: this
  process only saw a collective break (gloo, on CPU): it prints what the others posted,
  and with nothing posted (a peer killed outright) gives the runtime the heartbeat timeout
  to name the dead one."""
  pid, count = jax.process_index(), jax.process_count()
  client = _client()
  posted: dict[str, str] = {}
  try:
    client.key_value_set(f"{FAILED_KEY}{pid}", message, allow_overwrite=True)
    if pid == 0 and not peer_lost:
      deadline = time.time() + WAIT_FOR_PEERS_S
      for other in range(1, count):
        left_ms = int(1000 * (deadline - time.time()))
        if left_ms <= 0:
          break
        try:
          client.blocking_key_value_get(f"{FAILED_KEY}{other}", left_ms)
        except Exception:  # pylint: disable=broad-except
          break  # still at work (or dead): the heartbeat tells them
    if pid == 0 or peer_lost:  # the others leave at once: the store may go any moment
      posted = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(FAILED_KEY)}
  except Exception:  # pylint: disable=broad-except
    pass  # the store (process 0) is gone: the runtime's own error says why
  posted.pop(str(pid), None)  # the others' posts, by process index
  if peer_lost:
    for other, why in sorted(posted.items()):
      print(f"error: process {other} failed: {why}", file=sys.stderr)
    if not posted:
      print(f"error: a collective lost a process; waiting up to {heartbeat_timeout_s + 10} s "
            "for the runtime to name it", file=sys.stderr)
      sys.stderr.flush()
      time.sleep(heartbeat_timeout_s + 10)  # the runtime aborts this process meanwhile
      print("error: no process was named: every process still sends heartbeats",
            file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  if pid == 0 and posted:
    time.sleep(EXIT_GRACE_S)  # those that posted are exiting; the store outlives them
  os._exit(code)  # pylint: disable=protected-access
