"""gs:// paths end to end, against a local GCS emulator (conftest's `gcs` fixture).

Training into gs://bucket/run (corpus, packed data, checkpoints, metrics all in the
bucket), SIGKILLed after checkpoint N and resumed, logs the same per-step losses bit for
bit as an uninterrupted local run. A gs:// path with no credentials and no emulator is one
clear error naming the path. The emulator answers reads with their object's generation
(gcs_emulator.py's patch), as GCS does: OCDBT (orbax's checkpoints) depends on it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import tensorstore as ts
from etils import epath

from test_train_resume import KILL_SCRIPT, N, REPO, SETS, write_corpus

RUN = "gs://bucket/train_run"


def _losses_gs(workdir):
  text = epath.Path(workdir, "metrics.jsonl").read_text()
  recs = [json.loads(line) for line in text.splitlines() if line.strip()]
  return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def _cli(workdir, data, env, log):
  """The train CLI, its log in a file (a PIPE nobody reads would block it when full)."""
  return subprocess.Popen(
      [sys.executable, "-m", "prism_jax.cli", "train", f"--workdir={workdir}", f"--data={data}"]
      + [f"--set={s}" for s in SETS], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
      stderr=open(log, "w"))


def _checkpoint_complete(workdir, step):
  # on gs:// orbax finalizes with a commit file instead of a rename
  return epath.Path(workdir, "checkpoints", str(step), "commit_success.txt").exists()


def test_train_into_bucket_sigkill_then_resume_matches_uninterrupted(gcs, tmp_path):
  local = write_corpus(tmp_path / "corpus.txt")
  data = "gs://bucket/corpus/corpus.txt"
  epath.Path(data).write_bytes(open(local, "rb").read())
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **gcs)
  script = tmp_path / "killme.py"
  script.write_text(KILL_SCRIPT.format(park=N + 2))
  ref_dir = str(tmp_path / "ref")

  ref = _cli(ref_dir, local, env, tmp_path / "ref.log")  # local, uninterrupted, meanwhile
  doomed_log = tmp_path / "doomed.log"
  doomed = subprocess.Popen([sys.executable, str(script), RUN, data] + SETS, cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=open(doomed_log, "w"),
                            text=True)
  try:
    line = doomed.stdout.readline()
    assert line.strip() == "PARKED", doomed_log.read_text()[-3000:]
    deadline = time.time() + 120  # polled: a loaded 2-core box can take minutes
    while not _checkpoint_complete(RUN, N) and time.time() < deadline:
      time.sleep(0.2)
    assert _checkpoint_complete(RUN, N)
    doomed.send_signal(signal.SIGKILL)
    assert doomed.wait(timeout=30) == -signal.SIGKILL
  finally:
    if doomed.poll() is None:
      doomed.kill()
  killed = _losses_gs(RUN)
  assert max(killed) >= N  # uploaded with checkpoint N (then every 30 s)
  assert epath.Path(RUN, "data", "metadata.json").exists()  # packed into the bucket

  resumed = _cli(RUN, data, env, tmp_path / "resumed.log")
  assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
  assert f"resumed from checkpoint {N}" in (tmp_path / "resumed.log").read_text()
  assert ref.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
  with open(os.path.join(ref_dir, "metrics.jsonl")) as f:
    want = {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}
  got = _losses_gs(RUN)
  assert sorted(got) == sorted(want) == list(range(1, 2 * N + 1))
  for step in want:  # bit for bit: JSON keeps every bit of the float32 loss
    assert np.float32(got[step]).tobytes() == np.float32(want[step]).tobytes(), step
  assert all(killed[s] == want[s] for s in killed)


def test_gs_path_without_credentials_is_one_clear_error(tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                      "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GOOGLE_APPLICATION_CREDENTIALS")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, HOME=str(tmp_path),  # no gcloud config
             CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), GCE_METADATA_HOST="127.0.0.1:9")
  out = subprocess.run(
      [sys.executable, "-m", "prism_jax.cli", "train", "--workdir=gs://nobucket/run",
       "--set=train.steps=1"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=120)
  assert out.returncode != 0
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, out.stderr[-2000:]
  assert "gs://nobucket/run" in errors[0] and "credentials" in errors[0]


def test_emulator_reports_read_generations(gcs):
  """A read's generation is the object's (not 0), so conditional requests on it work; an
  OCDBT store reopened by a fresh context (a resumed process) reads and then writes its
  manifest. Without gcs_emulator's patch both fail with "Malformed StorageGeneration"."""
  kv = ts.KvStore.open({"driver": "gcs", "bucket": "bucket", "path": "gen/"}).result()
  written = kv.write("k", b"v1").result().generation
  read = kv.read("k").result()
  assert read.value == b"v1" and read.stamp.generation == written
  assert kv.read("k", if_not_equal=written).result().state in ("unspecified", "value")
  kv.write("k", b"v2", if_equal=written).result()
  spec = {"driver": "ocdbt", "base": {"driver": "gcs", "bucket": "bucket", "path": "ocdbt/"}}
  ts.KvStore.open(spec).result().write("a", b"1").result()
  fresh = ts.KvStore.open(spec, context=ts.Context()).result()
  assert fresh.read("a").result().value == b"1"
  fresh.write("b", b"2").result()
  assert ts.KvStore.open(spec, context=ts.Context()).result().read("b").result().value == b"2"
