"""How many simulated CPU devices each test process gets, and which files run where.

The files of MULTI_DEVICE_FILES test sharding, collectives or an 8-device mesh: they run
where JAX has 8 simulated CPU devices (a plain `pytest` run; under `--dist loadfile` with
several workers, the first worker, or the replacement of a crashed one). Every other file
runs on one device: its programs are then the ones the single-device subprocesses it
starts (the `prism` commands) compile, so the run's persistent compilation cache serves
both, and a 1-device program compiles and runs in less CPU than its 8-way SPMD twin."""

import jax
from xdist.scheduler import LoadFileScheduling

ALL_DEVICES = 8
MULTI_DEVICE_FILES = frozenset({
    "test_checkpoint_bad_inputs.py", "test_faithfulness.py", "test_grad_accum.py",
    "test_kernels.py",
    "test_kernels_sharded_model.py", "test_multihost.py", "test_scale_table.py",
    "test_sharding.py", "test_sharding_prototypes.py", "test_throughput.py",
    "test_train_eval.py", "test_train_golden.py"})


# The controller decides each worker's count and sends it in workerinput: xdist resets
# `dist` and `numprocesses` inside a worker, so a worker cannot tell a split run itself.
DEVICES_KEY = "prism_jax_devices"
_live: dict[str, int] = {}  # the controller's workers and their device counts


def splits_by_devices(config) -> bool:
  """Whether this run (on the controller) gives its files 1 or 8 devices by
  MULTI_DEVICE_FILES: xdist's `--dist loadfile` with at least two workers (`make test`)."""
  workers = getattr(config.option, "numprocesses", None)
  return (getattr(config.option, "dist", "no") == "loadfile" and isinstance(workers, int)
          and workers >= 2)


def assign_devices(worker_id: str) -> int:
  """The controller's choice for a new worker: 8 devices where no live worker has them
  (the first worker, or the replacement of a crashed one), else 1."""
  devices = 1 if ALL_DEVICES in _live.values() else ALL_DEVICES
  _live[worker_id] = devices
  return devices


def worker_down(worker_id: str) -> None:
  _live.pop(worker_id, None)


def device_count(config) -> int:
  """This process's simulated device count: what the controller sent a worker, else 8."""
  return getattr(config, "workerinput", {}).get(DEVICES_KEY, ALL_DEVICES)


def node_devices(node) -> int:
  return node.workerinput.get(DEVICES_KEY, ALL_DEVICES)


def needs_all_devices(path) -> bool:
  return path.name in MULTI_DEVICE_FILES


def check_devices(path) -> None:
  """One clear failure, not a shape error deep in a test, where a multi-device file landed
  in a one-device process."""
  if needs_all_devices(path) and jax.device_count() < ALL_DEVICES:
    raise RuntimeError(f"{path.name} needs {ALL_DEVICES} simulated devices and this process "
                       f"has {jax.device_count()} (tests/xdist_devices.py)")


class DeviceScheduling(LoadFileScheduling):
  """xdist's loadfile scheduling (whole files, in collection order: reordering by test count
  is off), except that a file goes to a worker with its device count: MULTI_DEVICE_FILES to
  the 8-device worker, the others to the one-device workers. A worker with nothing left it
  may run is shut down."""

  def schedule(self) -> None:
    if self.collection is None:
      # xdist shuts down the last-registered workers when files are fewer than workers:
      # keep the 8-device worker (first) so multi-device files still find it.
      self.assigned_work = dict(sorted(self.assigned_work.items(),
                                       key=lambda item: node_devices(item[0]) != ALL_DEVICES))
    super().schedule()

  def _runs_on(self, node, scope: str) -> bool:
    multi = scope.rsplit("/", 1)[-1] in MULTI_DEVICE_FILES
    if (node_devices(node) == ALL_DEVICES) == multi:
      return True
    # Where no live worker of the file's kind is left, another takes it (a multi-device
    # file then fails in one line: check_devices).
    return not any((node_devices(n) == ALL_DEVICES) == multi and not n.shutting_down
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
