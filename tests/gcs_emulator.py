"""A local GCS emulator for tests: gcp-storage-emulator (in memory, or on disk) on loopback.

`running()` starts the server (in memory, its own process) and points every client at it
with its own documented setting: STORAGE_EMULATOR_HOST (gcsfs, so etils epath; the google clients),
TENSORSTORE_GCS_HTTP_URL + GOOGLE_AUTH_TOKEN_FOR_TESTING (tensorstore's gcs kvstore, so
orbax's arrays and the attribution cache). Subprocesses inherit the environment.

The server runs through this file's `__main__` (`serve`), which patches one response of
gcp-storage-emulator 2026.7.19: its media download sends no `x-goog-generation` header,
which real GCS always sends. tensorstore's gcs kvstore takes a full or ranged read's
generation from that header, so without it every read object gets generation 0, and the
next conditional request on it (a cache revalidation `ifGenerationNotMatch`, or OCDBT's
manifest read-modify-write `ifGenerationMatch`) is refused client-side with "Malformed
StorageGeneration" (a GCS generation must be > 0). An OCDBT store that reads its
manifest and then writes it fails every time ("Error writing gs://.../manifest.ocdbt:
Malformed StorageGeneration", orbax's error in the gs:// resume test); an orbax save hits
that only when a manifest's generation came from a read rather than its own write, which
varies with timing: hence that test's intermittent failures.
`test_gcs.py::test_emulator_reports_read_generations` pins the patched behaviour.
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
def running(data_dir: str | None = None):
  """Yields the emulator's environment (also set in os.environ until the block ends).
  Objects live in the server's memory, or under `data_dir` on disk (a bucket of GBs: the
  `small` rehearsal's checkpoints and caches)."""
  port = free_port()
  # Its own process (this file's `serve`), so the tests' own processes stay light.
  server = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port)]
                            + ([os.path.abspath(data_dir)] if data_dir else []),
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


def _with_generation_headers(download):
  """The emulator's download handler, also answering GCS's x-goog-generation and
  x-goog-metageneration headers (see the module docstring)."""

  def patched(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status in (200, 206):
      obj = storage.get_file_obj(request.params["bucket_name"],
                                 request.params["object_id"])
      response["x-goog-generation"] = str(obj["generation"])
      response["x-goog-metageneration"] = str(obj["metageneration"])

  return patched


def _speed_up(server_lib, in_memory: bool) -> None:
  """Three costs of the emulator that are not GCS's behaviour, removed (20 zarr arrays of 8
  chunks written by tensorstore: 18.5 s -> 1.2 s):
  * its server (one thread) listens with socketserver's backlog of 5: tensorstore reads a
    chunked array over more connections than that at once, and each connection past the
    backlog waits for a SYN retransmit, 1 s (a 25-chunk array: 1.04 -> 0.01 s);
  * its handler answers with separate writes on a socket with Nagle's algorithm on, so a
    client's delayed ACK holds each response ~40 ms: TCP_NODELAY, as
    socketserver.StreamRequestHandler.disable_nagle_algorithm offers (one such array:
    1.05 -> 0.04 s);
  * every write re-serialises the whole bucket's metadata as indented JSON into `.meta`,
    which an in-memory store reads only when it starts: skipped in memory (16.4 -> 1.2 s
    with TCP_NODELAY)."""
  from gcp_storage_emulator import storage  # pylint: disable=import-outside-toplevel
  server_lib.RequestHandler.disable_nagle_algorithm = True
  server_lib.server.HTTPServer.request_queue_size = 1024
  if in_memory:
    storage.Storage._write_config_to_file = lambda self: None  # pylint: disable=protected-access


def serve(port: int, data_dir: str | None = None) -> None:
  """Runs the emulator (bucket BUCKET; in memory, or on disk under data_dir) on
  loopback:port until terminated."""
  # pylint: disable=import-outside-toplevel
  from gcp_storage_emulator import server as server_lib
  from gcp_storage_emulator.handlers import objects
  original = objects.download
  patched = _with_generation_headers(original)
  objects.download = patched  # objects.get(alt=media) calls it by its module name
  server_lib.HANDLERS = tuple(  # the route table holds the function itself
      (rx, {m: patched if h is original else h for m, h in handlers.items()})
      for rx, handlers in server_lib.HANDLERS)
  _speed_up(server_lib, data_dir is None)
  server_lib.create_server("127.0.0.1", port, in_memory=data_dir is None,
                           default_bucket=BUCKET, data_dir=data_dir).run()


if __name__ == "__main__":
  serve(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
