"""A local GCS emulator for tests: gcp-storage-emulator (in memory) on loopback.

`start()` runs the server in this process and points every client at it with its own
documented setting: STORAGE_EMULATOR_HOST (gcsfs, so etils epath; the google clients),
TENSORSTORE_GCS_HTTP_URL + GOOGLE_AUTH_TOKEN_FOR_TESTING (tensorstore's gcs kvstore, so
orbax's arrays and the attribution cache). Subprocesses inherit the environment.
"""

import contextlib
import logging
import os
import socket

BUCKET = "bucket"
ENV_KEYS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running():
  """Yields the emulator's environment (also set in os.environ until the block ends)."""
  from gcp_storage_emulator.server import create_server  # pylint: disable=import-outside-toplevel
  port = free_port()
  server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
  server.start()
  url = f"http://127.0.0.1:{port}"
  env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
         "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}
  saved = {k: os.environ.get(k) for k in ENV_KEYS}
  os.environ.update(env)
  # gcsfs probes the bucket type with the real control API first: a warning per call
  logging.getLogger("gcsfs").setLevel(logging.ERROR)
  try:
    yield env
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    server.stop()
