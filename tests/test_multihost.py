"""Multi-controller JAX on loopback: 2 processes x 4 CPU devices train like 1 x 8.

The same file is the worker: `python tests/test_multihost.py worker PID PORT WORKDIR`.
Each worker initialises jax.distributed on 127.0.0.1, feeds only its rows of each global
batch, trains 3 steps on a (2, 2, 2) mesh spanning both processes, saves an orbax
checkpoint from both processes, restores it onto a (1, 2, 4) mesh and checks it is exact.
"""

import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (no device is touched before the worker sets its count)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from absl import logging  # noqa: E402

from prism_jax import distributed, sharding  # noqa: E402
from prism_jax.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig  # noqa: E402
from prism_jax.train import checkpoint as ckpt_lib  # noqa: E402
from prism_jax.train import state as state_lib  # noqa: E402
from prism_jax.train import step as step_lib  # noqa: E402
from prism_jax.train.optimizer import make_optimizer  # noqa: E402
from multiprocess_env import multiprocess_env  # noqa: E402
from test_sharding import make_batches  # noqa: E402  (tests/ is on sys.path, also in workers)

NUM_PROCESSES, LOCAL_DEVICES, STEPS = 2, 4, 3
MESH_A, MESH_B = (2, 2, 2), (1, 2, 4)
TIMEOUT_S = 300


def _config():
  return Config(
      model=ModelConfig(vocab_size=64, max_len=16, d_model=32, n_layers=1, n_heads=4,
                        num_prototypes=64, k=4, proto_init="normal"),
      data=DataConfig(seq_len=16),
      train=TrainConfig(steps=10, batch_size=8, lr=1e-2, warmup_steps=2, proto_init_step=0))


def _train(cfg, mesh, batches):
  """3 steps of C's train step, each process feeding its own rows. (losses, state, sh)."""
  tx = make_optimizer(cfg.train)
  graphdef, state, shardings = state_lib.create_train_state(cfg, mesh, tx)
  step = step_lib.make_train_step(graphdef, cfg, tx, shardings, mesh)
  rows = cfg.train.batch_size
  index, count = sharding.process_batch_slice(mesh, rows)
  block = rows // count
  losses = []
  with jax.set_mesh(mesh):
    for batch in batches:
      local = {k: v[index * block:(index + 1) * block] for k, v in batch.items()}
      state, metrics = step(state, sharding.make_global_batch(local, mesh, rows))
      losses.append(float(metrics["loss"]))
  return losses, state, shardings, (index, count)


def worker(pid: int, port: int, workdir: str) -> None:
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  logging.set_verbosity(logging.INFO)  # as absl's app.run does by default
  assert distributed.initialize(f"127.0.0.1:{port}", NUM_PROCESSES, pid,
                                initialization_timeout=120)
  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
  cfg = _config()
  mesh = sharding.make_mesh(MeshConfig(*MESH_A))
  losses, state, shardings, shard = _train(cfg, mesh, make_batches(cfg, STEPS))

  ckpt = ckpt_lib.Checkpointer(workdir)  # every process saves and restores
  ckpt.save(STEPS, state, {"step": STEPS}, cfg)
  ckpt.wait()
  mesh_b = sharding.make_mesh(MeshConfig(*MESH_B))
  restored, data_state = ckpt.restore(STEPS, state_lib.abstract_state(cfg, mesh_b))
  ckpt.close()
  back = jax.device_put(restored, shardings)  # onto mesh A, across processes
  diff = jax.jit(lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(x - y)) for x, y in zip(
      jax.tree.leaves(a), jax.tree.leaves(b))])))(back, state)
  distributed.sync("done")
  result = {"losses": losses, "restore_max_abs_diff": float(diff), "step": int(restored.step),
            "data_state": data_state, "shard": list(shard),
            "restored_spec": str(restored.params["bank"]["protos"].sharding.spec),
            "log_verbosity": logging.get_verbosity()}
  with open(os.path.join(workdir, f"result_{pid}.json"), "w") as f:
    json.dump(result, f)


def test_resolve_from_flags_env_and_cluster():
  assert distributed.resolve(env={}) is None  # plain machine: one process
  assert distributed.resolve("10.0.0.1:1234", 4, 2, env={}) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
  env = {"PRISM_COORDINATOR_ADDRESS": "h0:9", "JAX_NUM_PROCESSES": "3", "PRISM_PROCESS_ID": "1"}
  assert distributed.resolve(env=env) == {"coordinator_address": "h0:9", "num_processes": 3,
                                          "process_id": 1}
  assert distributed.resolve(process_id=2, env=env)["process_id"] == 2  # flag beats env
  assert distributed.resolve(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == {}
  assert distributed.resolve(env={"TPU_WORKER_HOSTNAMES": "a,b,c,d"}) == {}
  assert distributed.resolve(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
  assert distributed.resolve(mode="on", env={}) == {}
  assert distributed.resolve("h:1", 4, 0, mode="off", env={}) is None
  with pytest.raises(ValueError, match="num_processes, process_id is not"):
    distributed.resolve("h0:9", env={})
  with pytest.raises(ValueError, match=r"process_id=4 not in \[0, num_processes=4\)"):
    distributed.resolve("h0:9", 4, 4, env={})
  with pytest.raises(ValueError, match="distributed mode 'maybe'"):
    distributed.resolve(mode="maybe", env={})


def test_single_process_batch_slice_and_no_runtime():
  assert sharding.process_batch_slice(sharding.make_mesh(MeshConfig(2, 2, 2)), 8) == (0, 1)
  assert distributed.initialize(mode="off") is False and distributed.is_main_process()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.long
def test_two_processes_train_like_one(tmp_path):
  port, env = _free_port(), multiprocess_env(JAX_PLATFORMS="cpu")
  logs = [open(tmp_path / f"log_{pid}.txt", "w") for pid in range(NUM_PROCESSES)]
  procs = [subprocess.Popen([sys.executable, __file__, "worker", str(pid), str(port),
                             str(tmp_path)], env=env, stdout=logs[pid],
                            stderr=subprocess.STDOUT)
           for pid in range(NUM_PROCESSES)]
  try:
    # Meanwhile, the reference: one process with 8 devices, same mesh shape and batches.
    cfg = _config()
    ref, _, _, _ = _train(cfg, sharding.make_mesh(MeshConfig(*MESH_A)), make_batches(cfg, STEPS))
    for p in procs:
      p.wait(timeout=TIMEOUT_S)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in logs:
      f.close()
  tails = [(tmp_path / f"log_{pid}.txt").read_text()[-3000:] for pid in range(NUM_PROCESSES)]
  assert all(p.returncode == 0 for p in procs), "\n---\n".join(tails)
  results = [json.loads((tmp_path / f"result_{pid}.json").read_text())
             for pid in range(NUM_PROCESSES)]
  assert [r["shard"] for r in results] == [[0, 2], [1, 2]]  # each fed half of the rows
  assert [r["log_verbosity"] for r in results] == [logging.INFO, logging.WARNING]
  for r in results:
    np.testing.assert_allclose(r["losses"], ref, rtol=1e-5)
    assert r["step"] == STEPS and r["data_state"] == {"step": STEPS}
    assert r["restore_max_abs_diff"] == 0.0
    assert r["restored_spec"] == "P('model', 'fsdp')"
  assert jax.device_count() == 8
  print(f"\n2 processes x 4 devices losses {results[0]['losses']}; 1 x 8 {list(ref)}")


if __name__ == "__main__":
  if len(sys.argv) == 5 and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
  else:
    sys.exit(f"usage: {sys.argv[0]} worker PID PORT WORKDIR")
