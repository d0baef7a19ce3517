"""gs:// paths against a local GCS emulator (conftest's `gcs` fixture).

Training into a bucket, SIGKILLed and resumed, is test_train_resume.py's. A gs:// path
with no credentials and no emulator is one clear error naming the path. The emulator answers reads with their object's generation
(gcs_emulator.py's patch), as GCS does: OCDBT (orbax's checkpoints) depends on it.
"""

import os
import subprocess
import sys

import tensorstore as ts

from test_train_resume import REPO


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
