"""The test run's device split (tests/xdist_devices.py): which worker gets how many
simulated devices and which files, and the clear failure of a misplaced file."""

import collections
import pathlib
import types

import jax
import pytest

import xdist_devices as xd


def _config(dist="loadfile", numprocesses=3):
  return types.SimpleNamespace(option=types.SimpleNamespace(dist=dist,
                                                            numprocesses=numprocesses))


def test_the_controller_gives_8_devices_to_one_live_worker_and_1_to_the_others(monkeypatch):
  monkeypatch.setattr(xd, "_live", {})
  assert xd.splits_by_devices(_config())
  assert not xd.splits_by_devices(_config(dist="load"))  # files split by test: 8 everywhere
  assert not xd.splits_by_devices(_config(numprocesses=1))
  assert not xd.splits_by_devices(_config(numprocesses=None))  # --tx without -n
  assert [xd.assign_devices(w) for w in ("gw0", "gw1", "gw2")] == [8, 1, 1]
  xd.worker_down("gw1")
  assert xd.assign_devices("gw3") == 1  # a one-device worker's replacement
  xd.worker_down("gw0")
  assert xd.assign_devices("gw4") == 8  # the 8-device worker's replacement
  worker = types.SimpleNamespace(workerinput={xd.DEVICES_KEY: 1, "workerid": "gw1"})
  assert xd.device_count(worker) == 1
  assert xd.device_count(types.SimpleNamespace(workerinput={"workerid": "gw1"})) == 8
  assert xd.device_count(_config()) == 8  # a process that is no worker


def test_this_process_has_the_devices_the_controller_sent(request):
  """Live: this file needs one device, so under `make test`'s split it runs on one."""
  sent = getattr(request.config, "workerinput", {}).get(xd.DEVICES_KEY)
  assert jax.device_count() == (sent or 8), (sent, jax.device_count())
  if sent is not None:  # the controller splits (make test): this file is a 1-device one
    assert sent == 1


class _Node:
  def __init__(self, wid, devices):
    self.gateway = types.SimpleNamespace(id=wid)
    self.workerinput = {xd.DEVICES_KEY: devices}
    self.shutting_down = False
    self.sent = []

  def shutdown(self):
    self.shutting_down = True

  def send_runtest_some(self, indices):
    self.sent.append(indices)


def _scheduler(nodes, files):
  sched = xd.DeviceScheduling.__new__(xd.DeviceScheduling)
  sched.workqueue = {f"tests/{f}": {f"tests/{f}::t{i}": False for i in range(2)}
                     for f in files}
  collection = [n for unit in sched.workqueue.values() for n in unit]
  sched.registered_collections = {n: collection for n in nodes}
  sched.assigned_work = {n: {} for n in nodes}  # xdist's `nodes` are its keys
  return sched, collection


def test_files_go_to_the_worker_with_their_device_count():
  gw0, gw1, gw2 = _Node("gw0", 8), _Node("gw1", 1), _Node("gw2", 1)
  files = ["test_a.py", "test_sharding.py", "test_b.py", "test_kernels.py", "test_c.py"]
  sched, collection = _scheduler([gw0, gw1, gw2], files)
  for node in (gw1, gw0, gw2, gw0, gw1):
    sched._assign_work_unit(node)  # pylint: disable=protected-access
  got = {n.gateway.id: sorted({collection[i].split("::")[0].split("/")[1] for s in n.sent
                               for i in s}) for n in (gw0, gw1, gw2)}
  assert got == {"gw0": ["test_kernels.py", "test_sharding.py"],
                 "gw1": ["test_a.py", "test_c.py"], "gw2": ["test_b.py"]}
  sched._assign_work_unit(gw0)  # pylint: disable=protected-access
  assert gw0.shutting_down and not sched.workqueue


@pytest.mark.parametrize("files", [["test_sharding.py"], ["test_a.py", "test_sharding.py"]])
def test_fewer_files_than_workers_keep_the_8_device_worker(files):
  """xdist shuts down the workers that registered last when files are fewer than workers;
  the 8-device worker registering last must still be kept for the multi-device file."""
  gw1, gw2, gw0 = _Node("gw1", 1), _Node("gw2", 1), _Node("gw0", 8)
  nodes = [gw1, gw2, gw0]
  sched, collection = _scheduler(nodes, files)
  sched.collection, sched.numnodes = None, len(nodes)
  sched.workqueue = collections.OrderedDict()  # schedule() fills it from the collections
  sched.config = types.SimpleNamespace(option=types.SimpleNamespace(loadscopereorder=False))
  sched.log = lambda *args: None
  sched.schedule()
  ran = {n.gateway.id: {collection[i].split("::")[0] for s in n.sent for i in s}
         for n in nodes}
  assert ran["gw0"] == {"tests/test_sharding.py"}
  assert sorted(f for n in nodes for f in ran[n.gateway.id]) == [f"tests/{f}" for f in files]
  assert all(n.shutting_down for n in nodes)  # all sent: each ends after its files


def test_a_crashed_multi_device_worker_leaves_its_files_to_the_others():
  gw1 = _Node("gw1", 1)
  sched, collection = _scheduler([gw1], ["test_sharding.py"])
  sched._assign_work_unit(gw1)  # pylint: disable=protected-access
  assert [collection[i] for i in gw1.sent[0]] == ["tests/test_sharding.py::t0",
                                                  "tests/test_sharding.py::t1"]


def test_a_multi_device_file_on_one_device_fails_in_one_line(monkeypatch):
  monkeypatch.setattr(xd.jax, "device_count", lambda: 1)
  with pytest.raises(RuntimeError, match="test_sharding.py needs 8 simulated devices and "
                                         "this process has 1"):
    xd.check_devices(pathlib.Path("tests/test_sharding.py"))
  xd.check_devices(pathlib.Path("tests/test_cards.py"))
