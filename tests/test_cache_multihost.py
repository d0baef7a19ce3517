"""The attribution cache built by 2 processes x 4 CPU devices (jax.distributed on loopback)
into gs:// (the emulator) equals the 1-process build bit for bit (the inverted index too,
each process writing its share) and answers a query with identical scores; one process
SIGKILLed mid-build and the job rerun resumes.

The same file is the worker: `python tests/test_cache_multihost.py worker PID PORT WORKDIR
CACHE [DIE]`: it initialises jax.distributed, opens the packed data from gs://, builds the
cache with `build_cache` (each process its share) and, with DIE, kills itself after its
first pass-2 chunk write.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from etils import epath  # noqa: E402

from prism_jax import distributed  # noqa: E402
from prism_jax.attribution.caching import cache as cache_lib  # noqa: E402
from prism_jax.attribution.caching import cache_format, cache_shards  # noqa: E402
from prism_jax.attribution.scoring import influence  # noqa: E402
from prism_jax.data import PackedData, prepare_data  # noqa: E402
from prism_jax.model.lm import build_model  # noqa: E402
import test_attribution as ta  # noqa: E402  (tests/ is on sys.path, also in workers)
from gcs_emulator import free_port  # noqa: E402
from multiprocess_env import multiprocess_env  # noqa: E402

NUM_PROCESSES, LOCAL_DEVICES, TIMEOUT_S = 2, 4, 240
PACKED = "gs://bucket/mh/data"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_CFG = dataclasses.replace(ta.CACHE_CFG, stat_shards=8)


def _config(workdir):
  cfg = ta.make_config(workdir)
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packed_dir=PACKED))


def worker(pid: int, port: int, workdir: str, out: str, die: bool | str) -> None:
  """`die`: True = process 1 SIGKILLs itself mid pass 2; "raise" = it raises there (the
  build then runs under the `prism` launcher, whose failure exit is under test)."""
  if die == "raise":
    from prism_jax.cli import launcher  # pylint: disable=import-outside-toplevel
    launcher.run(lambda argv: _build(pid, port, workdir, out, die, heartbeat_timeout_s=5),
                 [sys.argv[0]])
    return
  _build(pid, port, workdir, out, die)


def _build(pid, port, workdir, out, die, heartbeat_timeout_s=distributed.HEARTBEAT_TIMEOUT_S):
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  assert distributed.initialize(f"127.0.0.1:{port}", NUM_PROCESSES, pid,
                                initialization_timeout=120,
                                heartbeat_timeout_s=heartbeat_timeout_s)
  assert (jax.process_count(), jax.local_device_count()) == (NUM_PROCESSES, LOCAL_DEVICES)
  cfg = _config(workdir)

  prog = f"{out}/{cache_shards.progress_name(pid)}"
  index_writes = []

  def on_batch(pass_index, rows):  # dies mid pass 2, once its first chunks are written
    if die and pid == 1 and pass_index == 2 and cache_format.read_json(prog)["pass"] == 2:
      if die == "raise":
        raise RuntimeError("injected failure in pass 2")
      os.kill(os.getpid(), signal.SIGKILL)
    if pass_index == 3:  # this process wrote its share of the inverted index
      index_writes.append(rows)

  cache_lib.build_cache(build_model(cfg.model, 0), cfg, PackedData(PACKED), out, CACHE_CFG,
                        progress=False, on_batch=on_batch)
  print(f"BUILT, index writes {len(index_writes)}", flush=True)


def _read_all(path):
  out = {}
  for p in epath.Path(path).iterdir():
    if p.is_dir():
      out[p.name] = cache_format.store(path, p.name, CACHE_CFG.driver).read().result()
  meta = cache_format.read_json(f"{path}/{cache_format.METADATA}")
  meta.pop("build_seconds_last_run")
  return out, meta


def _launch(tmp_path, env, port, workdir, out, die, tag):
  logs = [tmp_path / f"{tag}_{pid}.log" for pid in range(NUM_PROCESSES)]
  flag = {True: ["die"], "raise": ["raise"]}.get(die, [])
  procs = [subprocess.Popen([sys.executable, __file__, "worker", str(pid), str(port), workdir,
                             out] + flag, env=env,
                            stdout=open(logs[pid], "w"), stderr=subprocess.STDOUT)
           for pid in range(NUM_PROCESSES)]
  return procs, logs


def _tails(logs):
  return "\n---\n".join(l.read_text()[-3000:] for l in logs)


@pytest.fixture(scope="module")
def reference(gcs, tmp_path_factory):
  """Packed data on gs://, the 1-process cache on gs:// and the same build locally."""
  workdir = str(tmp_path_factory.mktemp("mh"))
  rng = np.random.default_rng(1)
  with open(os.path.join(workdir, "docs.jsonl"), "w") as f:
    for _ in range(40):
      f.write(json.dumps({"text": " ".join(rng.choice(ta.WORDS, rng.integers(4, 25)))}) + "\n")
  cfg = _config(workdir)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, workdir)
  assert packed.path == PACKED and epath.Path(PACKED, "metadata.json").exists()
  model = build_model(cfg.model, 0)
  one = cache_lib.build_cache(model, cfg, packed, "gs://bucket/mh/cache1", CACHE_CFG,
                              progress=False)
  local = cache_lib.build_cache(model, cfg, packed, os.path.join(workdir, "cache"), CACHE_CFG,
                                progress=False)
  return workdir, cfg, packed, model, one, local


def test_cache_on_gcs_equals_the_local_cache(reference):
  _, _, _, _, one, local = reference
  got, meta_got = _read_all(one.path)
  want, meta_want = _read_all(local.path)
  assert meta_got == meta_want and sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  assert one.nbytes_per_token() > 0


@pytest.mark.long  # make test-long (issue 56 item 7): two processes, one killed and resumed
def test_two_process_build_equals_one_process_and_resumes_after_a_kill(reference, gcs,
                                                                      tmp_path):
  workdir, cfg, packed, model, one, _ = reference
  out = "gs://bucket/mh/cache2"
  env = multiprocess_env(JAX_PLATFORMS="cpu", **gcs,
             PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(__file__)]))
  # Run 1: process 1 kills itself after its first pass-2 write; process 0 is then stuck
  # at the end-of-pass barrier (or still writing) and is killed too: the job died.
  procs, logs = _launch(tmp_path, env, free_port(), workdir, out, True, "killed")
  try:
    assert procs[1].wait(timeout=TIMEOUT_S) == -signal.SIGKILL, _tails(logs)
    time.sleep(1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  prog1 = cache_format.read_json(f"{out}/{cache_shards.progress_name(1)}")
  assert prog1["pass"] == 2 and prog1["share"][0] < prog1["tokens_done"] < prog1["share"][1]
  with pytest.raises(ValueError, match="unfinished"):
    cache_lib.AttributionCache(out, model, cfg)

  # Run 2: the same job again resumes each process from its own progress.
  procs, logs = _launch(tmp_path, env, free_port(), workdir, out, False, "resumed")
  try:
    for p in procs:
      assert p.wait(timeout=TIMEOUT_S) == 0, _tails(logs)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for log in logs:  # both processes wrote a share of the index (cache_index.py)
    assert "BUILT, index writes 0" not in log.read_text() and "BUILT" in log.read_text()
  got, meta_got = _read_all(out)
  want, meta_want = _read_all(one.path)
  assert meta_got == meta_want and sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  two = cache_lib.AttributionCache(out, model, cfg, in_memory=False)  # reads chunks lazily
  tokens, pos = ta._query(packed)  # pylint: disable=protected-access
  icfg = influence.InfluenceConfig(top=5)
  a = influence.attribute(model, one, tokens, pos, cfg=icfg)
  b = influence.attribute(model, two, tokens, pos, cfg=icfg)
  np.testing.assert_array_equal(a.all_ids, b.all_ids)
  assert a.all_scores.tobytes() == b.all_scores.tobytes()
  # refused for another model, as for a local cache
  with pytest.raises(cache_lib.CacheMismatchError, match="another checkpoint"):
    cache_lib.AttributionCache(out, build_model(cfg.model, 1), cfg)


@pytest.mark.long
def test_an_exception_in_one_process_ends_the_build_on_every_process(reference, gcs,
                                                                       tmp_path):
  """Process 1 raises mid pass 2 (under the `prism` launcher): it exits 1 with its
  traceback, and process 0, waiting for it at the pass's barrier, exits non-zero within a
  bound with a line naming process 1 (its posted failure, or the runtime's heartbeat
  verdict), not after jax's 300 s shutdown barrier."""
  workdir = reference[0]
  env = multiprocess_env(JAX_PLATFORMS="cpu", **gcs,
                         PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(__file__)]))
  procs, logs = _launch(tmp_path, env, free_port(), workdir, "gs://bucket/mh/cache3",
                        "raise", "raised")
  try:
    assert procs[1].wait(timeout=TIMEOUT_S) == 1, _tails(logs)
    t0 = time.time()
    code0 = procs[0].wait(timeout=90)
    elapsed = time.time() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  err0, err1 = logs[0].read_text(), logs[1].read_text()
  assert "RuntimeError: injected failure in pass 2" in err1, err1[-3000:]
  assert code0 != 0 and elapsed < 60, (code0, elapsed, err0[-3000:])
  assert "Shutdown barrier" not in err0 + err1, (err0 + err1)[-3000:]
  assert ("error: process 1 failed: RuntimeError: injected failure in pass 2" in err0
          or re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", err0)
          or re.search(r"task[^\n]*\b1\b[^\n]*(heartbeat|unhealthy|died|crash)", err0,
                       re.I)), err0[-3000:]
  print(f"\nprocess 0 exited {code0} {elapsed:.1f} s after process 1 raised")


def test_shares_are_chunk_aligned_and_cover_every_token():
  for n, chunk, count in ((0, 4, 2), (10, 4, 2), (1000, 96, 3), (95, 96, 2), (97, 96, 4)):
    shares = [cache_shards.token_share(n, chunk, p, count) for p in range(count)]
    assert shares[0][0] == 0 and shares[-1][1] == n
    for (a, b), (c, d) in zip(shares, shares[1:]):
      assert b == c and a % chunk == 0 and c % chunk == 0 and a <= b <= d
  ranges = cache_shards.stat_shards(27, 4, 8)
  assert ranges[0][0] == 0 and ranges[-1][1] == 27 and all(
      b == c and a % 4 == 0 for (a, b), (c, _) in zip(ranges, ranges[1:]))
  with pytest.raises(ValueError, match="stat_shards >= the process count"):
    cache_shards.check_processes(2, 3)


def test_attribute_cli_needs_a_prompt_unless_build_only(tmp_path):
  out = subprocess.run([sys.executable, "-m", "prism_jax.cli", "attribute",
                        f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      "error: --prompt is required (or --build_only to only build the cache)"]

if __name__ == "__main__":
  if len(sys.argv) in (6, 7) and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
           {6: False, 7: "raise" if sys.argv[-1] == "raise" else True}[len(sys.argv)])
  else:
    sys.exit(f"usage: {sys.argv[0]} worker PID PORT WORKDIR CACHE [die|raise]")
