"""Packing at scale (issue 28): many pieces, worker processes, 2 processes on gs://, resume.

A corpus of jsonl, txt and multi-row-group parquet files is cut into ~10 pieces (tiny
piece_bytes). The pack must be the same bits whatever packs it: 1 process in-process, 1
process with 2 worker processes, 2 jax.distributed processes writing to the gs://
emulator; a process killed mid-pack resumes from its finished pieces to the same bits.
Independent checks: every document's tokens read back equal the tokenizer's encoding of
its text, and every (document, offset) is a target exactly once.

The same file is the worker: `python tests/test_data_pack_parallel.py worker PID PORT
CORPUS OUT [die]` packs with jax.distributed as process PID of 2; with `die`, process 1
SIGKILLs itself once its first piece is done. `... slow CORPUS OUT` packs with 2 worker
processes that each take SLOW_PIECE_S per piece (the orphan test SIGKILLs it mid-way).
"""

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from prism_jax.config import DataConfig  # noqa: E402
from prism_jax.data import PackedData, pack, packing  # noqa: E402
from prism_jax.data import pack_format as fmt  # noqa: E402
from prism_jax.data import piece as piece_lib  # noqa: E402

PIECE_BYTES, VOCAB, TIMEOUT_S = 3000, 300, 240
SLOW_PIECE_S = 0.4
_PACK_PIECE_IN_WORKER = piece_lib.pack_piece_in_worker
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["alpha", "beta", "gamma", "δέλτα", "日本", "x", "yz", "the", "a", "packing"]


def write_corpus(d: str) -> DataConfig:
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(28)
  text = lambda: " ".join(rng.choice(WORDS, int(rng.integers(3, 40))))
  for i in range(2):
    with open(os.path.join(d, f"a{i}.jsonl"), "w", encoding="utf-8") as f:
      for _ in range(30):
        f.write(json.dumps({"text": text()}, ensure_ascii=False) + "\n")
  with open(os.path.join(d, "b.txt"), "w", encoding="utf-8") as f:
    f.write("\n\n".join(text() for _ in range(20)))
  table = pa.table({"text": [text() if i % 7 else "" for i in range(120)]})
  pq.write_table(table, os.path.join(d, "c.parquet"), row_group_size=20)
  return corpus_config(d)


def corpus_config(d: str) -> DataConfig:
  return DataConfig(sources=(os.path.join(d, "*.jsonl"), os.path.join(d, "b.txt"),
                             os.path.join(d, "c.parquet")),
                    tokenizer="bpe", seq_len=16, val_fraction=0.15, txt_documents="200")


def read_all(path):
  """Everything a reader sees: metadata (less the run time), rows, documents."""
  p = PackedData(path)
  meta = dict(p.metadata)
  meta.pop("seconds_last_run")
  rows = {s: {f: np.asarray(v) for f, v in p.rows(s).items()} for s in fmt.SPLITS}
  docs = [(p.document_name(i), p.document_split(i), p.document_tokens(i, with_eos=True))
          for i in range(p.num_documents)]
  return meta, rows, docs


def assert_same(a, b):
  assert a[0] == b[0]
  for s in fmt.SPLITS:
    for f in fmt.FIELDS:
      np.testing.assert_array_equal(a[1][s][f], b[1][s][f], err_msg=f"{s} {f}")
  assert len(a[2]) == len(b[2])
  for (n1, s1, t1), (n2, s2, t2) in zip(a[2], b[2]):
    assert (n1, s1) == (n2, s2)
    np.testing.assert_array_equal(t1, t2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("corpus"))
  cfg = write_corpus(d)
  out = pack(cfg, VOCAB, os.path.join(d, "ref"), workers=0, piece_bytes=PIECE_BYTES)
  return d, cfg, out, read_all(out)


def test_many_pieces_match_an_independent_reading(reference):
  from prism_jax.data import sources  # pylint: disable=import-outside-toplevel
  _, cfg, out, (meta, rows, _) = reference
  packed = PackedData(out)
  assert len(meta["pieces"]["documents"]) >= 8  # the corpus really is cut into pieces
  docs = list(sources.iter_documents(cfg.sources, txt_documents=cfg.txt_documents))
  assert packed.num_documents == len(docs) == meta["counts"]["documents"]
  tok = packed.tokenizer
  for d in docs:  # ids, names and tokens as the sources and the tokenizer give them
    assert packed.document_name(d.example_id) == d.name
    np.testing.assert_array_equal(packed.document_tokens(d.example_id), tok.encode(d.text))
  seen = collections.Counter()
  for s in fmt.SPLITS:
    eid, off = rows[s]["example_id"][:, 1:], rows[s]["offset"][:, 1:]
    real = eid >= 0
    seen.update(zip(eid[real].tolist(), off[real].tolist()))
    assert {packed.document_split(e) for e in set(eid[real].tolist())} == {s}
    tokens = rows[s]["tokens"][:, 1:][real]
    want = np.concatenate([np.append(tok.encode(docs[e].text), tok.eos_id)[o:o + 1]
                           for e, o in zip(eid[real].tolist(), off[real].tolist())])
    np.testing.assert_array_equal(tokens, want)
  assert set(seen) == {(d.example_id, o) for d in docs
                       for o in range(len(tok.encode(d.text)) + 1)}
  assert max(seen.values()) == 1
  assert 0 < meta["counts"]["val"]["documents"] < meta["counts"]["train"]["documents"]


def test_worker_processes_give_the_same_bits(reference):
  d, cfg, _, want = reference
  out = pack(cfg, VOCAB, os.path.join(d, "w2"), workers=2, piece_bytes=PIECE_BYTES)
  assert_same(read_all(out), want)


def test_interrupted_pack_resumes_from_its_finished_pieces(reference, monkeypatch):
  d, cfg, _, want = reference
  out = os.path.join(d, "resumed")
  original, done = piece_lib.pack_piece, []

  def stop_after_three(*args):
    if len(done) == 3:
      raise KeyboardInterrupt  # e.g. Ctrl-C, or a kill, between two pieces
    done.append(original(*args))
    return done[-1]

  monkeypatch.setattr(piece_lib, "pack_piece", stop_after_three)
  with pytest.raises(KeyboardInterrupt):
    pack(cfg, VOCAB, out, workers=0, piece_bytes=PIECE_BYTES)
  assert not os.path.exists(os.path.join(out, fmt.METADATA))
  with pytest.raises(FileNotFoundError, match="unfinished pack"):
    PackedData(out)
  assert packing.check_existing(out, packing.pack_config(cfg, VOCAB, PIECE_BYTES),
                                json.load(open(os.path.join(out, fmt.PLAN)))["source_hash"]
                                ) == "partial"
  stamps = {s["piece"]: os.stat(os.path.join(fmt.piece_dir(out, s["piece"]), fmt.DONE)
                                ).st_mtime_ns for s in done}
  monkeypatch.setattr(piece_lib, "pack_piece", original)
  assert pack(cfg, VOCAB, out, workers=0, piece_bytes=PIECE_BYTES) == out
  assert_same(read_all(out), want)
  assert {k: os.stat(os.path.join(fmt.piece_dir(out, k), fmt.DONE)).st_mtime_ns
          for k in stamps} == stamps  # finished pieces were not redone
  with pytest.raises(ValueError, match="unfinished pack in .* different config: seq_len"):
    os.remove(os.path.join(out, fmt.METADATA))
    pack(dataclasses.replace(cfg, seq_len=8), VOCAB, out, piece_bytes=PIECE_BYTES)


# --- two processes on the gs:// emulator ---------------------------------------------


def worker(pid: int, port: int, corpus: str, out: str, die: bool) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from prism_jax import distributed  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", 1)
  assert distributed.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=120)
  original = piece_lib.pack_piece

  def logged(out_dir, piece, k, settings, tok):
    summary = original(out_dir, piece, k, settings, tok)
    print(f"PIECE {k}", flush=True)
    if die and pid == 1:
      os.kill(os.getpid(), signal.SIGKILL)
    return summary

  piece_lib.pack_piece = logged
  pack(corpus_config(corpus), VOCAB, out, workers=0, piece_bytes=PIECE_BYTES)
  print("PACKED", flush=True)


def _launch(tmp_path, env, corpus, out, die, tag):
  from gcs_emulator import free_port  # pylint: disable=import-outside-toplevel
  port = free_port()
  logs = [tmp_path / f"{tag}_{pid}.log" for pid in range(2)]
  procs = [subprocess.Popen([sys.executable, __file__, "worker", str(pid), str(port), corpus,
                             out] + (["die"] if die else []), env=env,
                            stdout=open(logs[pid], "w"), stderr=subprocess.STDOUT)
           for pid in range(2)]
  return procs, logs


def _pieces(log):
  return {int(line.split()[1]) for line in log.read_text().splitlines()
          if line.startswith("PIECE ")}


def test_two_processes_on_gcs_equal_one_and_resume_after_a_kill(reference, gcs, tmp_path):
  from etils import epath  # pylint: disable=import-outside-toplevel
  corpus, _, _, want = reference
  out = "gs://bucket/pack2"
  env = dict(os.environ, JAX_PLATFORMS="cpu", **gcs,
             PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(__file__)]))
  procs, logs = _launch(tmp_path, env, corpus, out, True, "killed")
  tails = lambda: "\n---\n".join(l.read_text()[-3000:] for l in logs)
  try:
    assert procs[1].wait(timeout=TIMEOUT_S) == -signal.SIGKILL, tails()
    time.sleep(1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  assert not epath.Path(out, fmt.METADATA).exists()
  first = _pieces(logs[1])
  assert len(first) == 1 and min(first) % 2 == 1  # process 1 packs the odd pieces
  procs, logs = _launch(tmp_path, env, corpus, out, False, "resumed")
  try:
    for p in procs:
      assert p.wait(timeout=TIMEOUT_S) == 0, tails()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  n = len(want[0]["pieces"]["documents"])
  assert _pieces(logs[1]) == set(range(1, n, 2)) - first  # its finished piece was kept
  assert _pieces(logs[0]) <= set(range(0, n, 2))
  assert_same(read_all(out), want)


def test_gcs_sources_hash_by_stored_checksum_without_download(gcs, monkeypatch):
  from etils import epath  # pylint: disable=import-outside-toplevel
  from prism_jax.data import sources  # pylint: disable=import-outside-toplevel
  path = "gs://bucket/hash/a.txt"
  epath.Path(path).write_text("one two three")
  h1 = sources.source_hash([path])
  epath.Path(path).write_text("one two thre3")  # same size, other content
  with monkeypatch.context() as m:
    m.setattr(sources.paths_lib, "open_file", lambda *a: pytest.fail("downloaded"))
    assert sources.source_hash([path]) != h1
  epath.Path(path).write_text("one two three")
  assert sources.source_hash([path]) == h1



# --- a killed pack takes its worker processes with it (issue 49) ---------------------


def slow_piece_in_worker(*args):
  """The real worker function, slowed so a kill lands mid-pack (runs in the workers)."""
  time.sleep(SLOW_PIECE_S)
  return _PACK_PIECE_IN_WORKER(*args)


def slow_pack(corpus: str, out: str) -> None:
  piece_lib.pack_piece_in_worker = slow_piece_in_worker  # pickled by name: the workers
  # import this module and run the wrapper around their own, real, function
  pack(corpus_config(corpus), VOCAB, out, workers=2, piece_bytes=PIECE_BYTES)


def _alive(procs) -> list:
  import psutil  # pylint: disable=import-outside-toplevel
  out = []
  for p in procs:
    try:
      if p.status() != psutil.STATUS_ZOMBIE:  # a zombie holds no memory and runs nothing
        out.append(p)
    except psutil.NoSuchProcess:
      pass
  return out


def test_sigkilled_pack_leaves_no_worker_alive_and_resumes_to_the_same_rows(reference,
                                                                           tmp_path):
  import psutil  # pylint: disable=import-outside-toplevel
  corpus, cfg, _, want = reference
  out = str(tmp_path / "killed")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(__file__)]))
  log = tmp_path / "slow.log"
  proc = subprocess.Popen([sys.executable, __file__, "slow", corpus, out], env=env,
                          stdout=open(log, "w"), stderr=subprocess.STDOUT)
  done = lambda: [k for k in range(len(want[0]["pieces"]["documents"]))
                  if os.path.exists(os.path.join(fmt.piece_dir(out, k), fmt.DONE))]
  try:
    deadline = time.time() + TIMEOUT_S
    while not done() and time.time() < deadline and proc.poll() is None:
      time.sleep(0.05)
    kids = psutil.Process(proc.pid).children(recursive=True)
    cmdlines = [" ".join(_cmdline(p)) for p in kids]
    assert done() and proc.poll() is None, log.read_text()[-3000:]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
  finally:
    if proc.poll() is None:
      proc.kill()
  assert sum("spawn_main" in c for c in cmdlines) == 2, cmdlines  # the pool's 2 workers
  assert not os.path.exists(os.path.join(out, fmt.METADATA))  # it really was mid-way
  finished = set(done())
  t0 = time.time()
  while _alive(kids) and time.time() - t0 < 10:
    time.sleep(0.1)
  left = _alive(kids)
  for p in left:
    p.kill()
  assert not left, f"alive {time.time() - t0:.1f} s after the kill: {cmdlines}"
  assert finished <= set(done())  # finished pieces are kept ...
  resumed = pack(cfg, VOCAB, out, workers=0, piece_bytes=PIECE_BYTES)
  assert_same(read_all(resumed), want)  # ... and the rerun completes to the same rows


def _cmdline(p) -> list[str]:
  import psutil  # pylint: disable=import-outside-toplevel
  try:
    return p.cmdline()
  except psutil.Error:
    return []


if __name__ == "__main__":
  if len(sys.argv) in (6, 7) and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], len(sys.argv) == 7)
  elif len(sys.argv) == 4 and sys.argv[1] == "slow":
    slow_pack(sys.argv[2], sys.argv[3])
  else:
    sys.exit(f"usage: {sys.argv[0]} worker PID PORT CORPUS OUT [die] | slow CORPUS OUT")
