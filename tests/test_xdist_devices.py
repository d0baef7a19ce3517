"""The test run's device split (tests/xdist_devices.py): which worker gets how many
simulated devices and which files, and the clear failure of a misplaced file."""

import pathlib
import types

import pytest

import xdist_devices as xd


def _config(dist="loadfile", numprocesses=3, worker=None):
  cfg = types.SimpleNamespace(option=types.SimpleNamespace(dist=dist,
                                                           numprocesses=numprocesses))
  if worker is not None:
    cfg.workerinput = {"workerid": worker, "workercount": numprocesses}
  return cfg


def test_device_count_per_process():
  assert xd.device_count(_config()) == 8  # the controller
  assert xd.device_count(_config(worker="gw0")) == 8
  assert xd.device_count(_config(worker="gw1")) == 1
  assert xd.device_count(_config(worker="gw5")) == 1  # a replacement for a crashed worker
  assert xd.device_count(_config(dist="load", worker="gw1")) == 8  # files split by test
  assert xd.device_count(_config(numprocesses=1, worker="gw0")) == 8
  assert xd.device_count(_config(numprocesses="auto")) == 8


class _Node:
  def __init__(self, wid):
    self.gateway = types.SimpleNamespace(id=wid)
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
  gw0, gw1, gw2 = _Node("gw0"), _Node("gw1"), _Node("gw2")
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


def test_a_crashed_multi_device_worker_leaves_its_files_to_the_others():
  gw1 = _Node("gw1")
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
