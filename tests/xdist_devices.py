"""How many simulated CPU devices each test process gets, and which files run where.

The files of MULTI_DEVICE_FILES test sharding, collectives or an 8-device mesh: they run
where JAX has 8 simulated CPU devices (a plain `pytest` run, and xdist's worker gw0 under
`--dist loadfile`). Every other file runs on one device: its programs are then the ones the
single-device subprocesses it starts (the `prism` commands) compile, so the run's
persistent compilation cache serves both, and a 1-device program compiles and runs in less
CPU than its 8-way SPMD twin. Measured on the whole suite (2 cores): 1289 -> 669 user-s,
all files on one device (the 8-device files failing fast).
"""

import jax
from xdist.scheduler import LoadFileScheduling

ALL_DEVICES = 8
MULTI_DEVICE_WORKER = "gw0"
MULTI_DEVICE_FILES = frozenset({
    "test_checkpoint_bad_inputs.py", "test_faithfulness.py", "test_kernels.py",
    "test_kernels_sharded_model.py", "test_multihost.py", "test_scale_table.py",
    "test_sharding.py", "test_sharding_prototypes.py", "test_throughput.py",
    "test_train_eval.py", "test_train_golden.py"})


def splits_by_devices(config) -> bool:
  """Whether this run gives its files 1 or 8 devices by MULTI_DEVICE_FILES: xdist's
  `--dist loadfile` with at least two workers (`make test`)."""
  if getattr(config.option, "dist", "no") != "loadfile":
    return False
  worker = getattr(config, "workerinput", None)
  workers = worker["workercount"] if worker else config.option.numprocesses
  return isinstance(workers, int) and workers >= 2


def device_count(config) -> int:
  """This process's simulated device count (a worker reads its id from xdist)."""
  worker = getattr(config, "workerinput", None)
  if worker is None or not splits_by_devices(config):
    return ALL_DEVICES
  return ALL_DEVICES if worker["workerid"] == MULTI_DEVICE_WORKER else 1


def needs_all_devices(path) -> bool:
  return path.name in MULTI_DEVICE_FILES


def check_devices(path) -> None:
  """One clear failure, not a shape error deep in a test, where a multi-device file landed
  in a one-device process."""
  if needs_all_devices(path) and jax.device_count() < ALL_DEVICES:
    raise RuntimeError(f"{path.name} needs {ALL_DEVICES} simulated devices and this process "
                       f"has {jax.device_count()} (tests/xdist_devices.py)")


class DeviceScheduling(LoadFileScheduling):
  """xdist's loadfile scheduling (whole files, in collection order), except that a file
  goes to a worker with its device count: MULTI_DEVICE_FILES to gw0, the others to the
  one-device workers. A worker with nothing left it may run is shut down."""

  def _runs_on(self, node, scope: str) -> bool:
    multi = scope.rsplit("/", 1)[-1] in MULTI_DEVICE_FILES
    if (node.gateway.id == MULTI_DEVICE_WORKER) == multi:
      return True
    # Where no live worker of the file's kind is left (a crashed gw0 is replaced by a
    # one-device worker), another takes it: a multi-device file then fails clearly.
    return not any((n.gateway.id == MULTI_DEVICE_WORKER) == multi and not n.shutting_down
                   for n in self.nodes)

  def _assign_work_unit(self, node) -> None:
    scope = next((s for s in self.workqueue if self._runs_on(node, s)), None)
    if scope is None:
      node.shutdown()
      return
    work_unit = self.workqueue.pop(scope)
    self.assigned_work.setdefault(node, {})[scope] = work_unit
    collection = self.registered_collections[node]
    node.send_runtest_some([collection.index(nodeid)
                            for nodeid, completed in work_unit.items() if not completed])
