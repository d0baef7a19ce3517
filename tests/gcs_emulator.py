"""A local GCS emulator for tests: gcp-storage-emulator (in memory) on loopback.

`running()` starts the server (in memory, its own process) and points every client at it
with its own documented setting: STORAGE_EMULATOR_HOST (gcsfs, so etils epath; the google clients),
TENSORSTORE_GCS_HTTP_URL + GOOGLE_AUTH_TOKEN_FOR_TESTING (tensorstore's gcs kvstore, so
orbax's arrays and the attribution cache). Subprocesses inherit the environment.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time

BUCKET = "bucket"
ENV_KEYS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running():
  """Yields the emulator's environment (also set in os.environ until the block ends)."""
  port = free_port()
  # Its own process (the package's CLI): served in a thread of the test process, writes
  # from the subprocesses under test were seen to fail ("Malformed StorageGeneration").
  server = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start",
                             "--host", "127.0.0.1", "--port", str(port), "--in-memory",
                             "--default-bucket", BUCKET],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 30
    while True:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
      except OSError:
        if server.poll() is not None or time.time() > deadline:
          raise RuntimeError("the GCS emulator did not start") from None
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
           # gcsfs's default probes the real bucket-type API (a warning on every call)
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(env)
    try:
      yield env
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
  finally:
    server.terminate()
    try:
      server.wait(timeout=10)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()
