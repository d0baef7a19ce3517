"""Packing throughput and memory at scale (issue 28): P processes x W workers.

  nice -n 10 python benchmarks/bench_pack.py --text_gb=1 --processes=1 --workers=2

Generates (once, cached under --corpus_dir) a seeded synthetic parquet corpus of
--text_gb of text: documents of English words drawn from the embedded corpus's word
frequencies, in files of --file_mb with row groups of --group_rows rows (FineWeb-like;
file f drawn from the seed (--seed, f)).
Packs it with --processes jax.distributed processes on loopback (each with --workers
worker processes; 0 packs in the process) and prints tokens/s per core (tokens per CPU
second of the packing processes and their workers: on a shared box the wall clock counts
other jobs too; the wall-clock rate is printed beside it), the peak RSS
of the packing processes and of their workers, and the time a 10B-token pack would take
on a v5e-16's four hosts (--host_cores each) at the measured per-core rate. The JSON
line it prints ("RESULT {...}") carries the argv and the git commit.
"""

from __future__ import annotations

import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# after the path: run as a file too
from prism_jax.cli import flag_checks as check  # noqa: E402
from prism_jax.cli import launcher  # noqa: E402
from prism_jax.cli import provenance  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("text_gb", 0.25, "corpus size in GB of text (UTF-8 bytes)")
flags.DEFINE_integer("processes", 1, "packing processes (jax.distributed on loopback)")
flags.DEFINE_integer("workers", 2, "worker processes per packing process (0: in-process)")
flags.DEFINE_string("tokenizer", "gpt2", "data.tokenizer")
flags.DEFINE_integer("vocab_size", 50304, "model.vocab_size")
flags.DEFINE_integer("seq_len", 1024, "data.seq_len")
flags.DEFINE_integer("file_mb", 64, "text per parquet file, MB")
flags.DEFINE_integer("group_rows", 1000, "rows per parquet row group")
flags.DEFINE_string("corpus_dir", "/tmp/prism_bench_pack/corpus", "where the corpus is cached")
flags.DEFINE_string("out", "/tmp/prism_bench_pack/packed", "pack directory (removed first)")
flags.DEFINE_integer("host_cores", 112, "cores per v5e host (ct5lp-hightpu-4t: 112 vCPUs)")
flags.DEFINE_integer("seed", 0, "corpus seed")
# internal: one packing process of the job
flags.DEFINE_integer("pid", -1, "internal: this process's id")
flags.DEFINE_integer("port", 0, "internal: coordinator port")

TARGET_TOKENS, V5E16_HOSTS = 10e9, 4


def _words():
  """(words, probabilities) of the embedded corpus: realistic English for the tokenizer."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  counts = collections.Counter(re.findall(r"[A-Za-z]+[,.]?", " ".join(topics.topics.values())))
  words = sorted(counts)
  p = np.array([counts[w] for w in words], np.float64)
  return np.array(words, object), p / p.sum()


def _write_file(args) -> None:
  """Corpus file f: documents from its own seed until it holds `size` bytes of text."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  path, size, seed, f, group_rows = args
  words, p = _words()
  rng = np.random.default_rng([seed, f])
  docs, n_bytes = [], 0
  while n_bytes < size:
    n = int(rng.lognormal(6.0, 0.8))  # ~500 words (~3 KB), FineWeb-like spread
    docs.append(" ".join(words[rng.choice(len(words), n, p=p)]))
    n_bytes += len(docs[-1])
  pq.write_table(pa.table({"text": docs}), path, row_group_size=group_rows)


def make_corpus(directory: str, text_gb: float, file_mb: int, group_rows: int, seed: int,
                jobs: int):
  """Seeded parquet files totalling text_gb of text (file f from seed (seed, f), written
  by `jobs` processes); reused when already there."""
  import multiprocessing  # pylint: disable=import-outside-toplevel
  tag = os.path.join(directory, f"gb{text_gb}_f{file_mb}_g{group_rows}_s{seed}")
  if not os.path.isfile(os.path.join(tag, "DONE")):
    shutil.rmtree(tag, ignore_errors=True)
    os.makedirs(tag)
    total, file_bytes = int(text_gb * 1e9), file_mb * 10**6
    tasks = [(os.path.join(tag, f"part-{f:05d}.parquet"), min(file_bytes, total - start),
              seed, f, group_rows) for f, start in enumerate(range(0, total, file_bytes))]
    with multiprocessing.get_context("spawn").Pool(max(1, jobs)) as pool:
      pool.map(_write_file, tasks)
    open(os.path.join(tag, "DONE"), "w").close()
  return sorted(os.path.join(tag, n) for n in os.listdir(tag) if n.endswith(".parquet"))


def _peak_mb(who) -> float:
  return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


def _cpu_s() -> float:
  """CPU seconds of this process and its finished children (the worker processes)."""
  a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def pack_process(files) -> None:
  """One packing process: pack its share, print its wall time and peak RSS."""
  from prism_jax.config import DataConfig  # pylint: disable=import-outside-toplevel
  if FLAGS.processes > 1:
    from prism_jax import distributed  # pylint: disable=import-outside-toplevel
    distributed.initialize(f"127.0.0.1:{FLAGS.port}", FLAGS.processes, FLAGS.pid)
  from prism_jax.data import PackedData, pack  # pylint: disable=import-outside-toplevel
  cfg = DataConfig(sources=tuple(files), tokenizer=FLAGS.tokenizer, seq_len=FLAGS.seq_len,
                   val_fraction=0.005)
  t0, cpu0 = time.time(), _cpu_s()
  out = pack(cfg, FLAGS.vocab_size, FLAGS.out, workers=FLAGS.workers)
  wall, cpu = time.time() - t0, _cpu_s() - cpu0
  counts = PackedData(out).metadata["counts"]
  print("PROCESS " + json.dumps({"pid": FLAGS.pid, "wall_s": wall, "cpu_s": cpu,
                                 "tokens": counts["tokens"],
                                 "rss_mb": _peak_mb(resource.RUSAGE_SELF),
                                 "worker_rss_mb": _peak_mb(resource.RUSAGE_CHILDREN)}),
        flush=True)


def check_flags() -> None:
  """Every flag combination, before the corpus is written or --out removed (one
  `error:` line)."""
  check.in_range("text_gb", FLAGS.text_gb, 0, float("inf"), low_open=True)
  check.at_least(1, processes=FLAGS.processes, vocab_size=FLAGS.vocab_size,
                 seq_len=FLAGS.seq_len, file_mb=FLAGS.file_mb, group_rows=FLAGS.group_rows,
                 host_cores=FLAGS.host_cores)
  check.at_least(0, workers=FLAGS.workers)
  from prism_jax.config import DataConfig  # pylint: disable=import-outside-toplevel
  DataConfig(tokenizer=FLAGS.tokenizer, seq_len=FLAGS.seq_len)  # the tokenizer's name
  # --out is removed first: it must not hold the corpus (or be one of its parents)
  out, corpus = os.path.abspath(FLAGS.out), os.path.abspath(FLAGS.corpus_dir)
  if os.path.commonpath([out, corpus]) == out:
    raise ValueError(f"--out={FLAGS.out}: it is removed before packing and holds "
                     f"--corpus_dir={FLAGS.corpus_dir}; give another folder")
  if FLAGS.pid >= FLAGS.processes:
    raise ValueError(f"--pid={FLAGS.pid}: internal, below --processes={FLAGS.processes}")


def main(argv):
  del argv
  check_flags()
  prov = provenance.record("benchmarks.bench_pack")  # at the start: the code that runs
  files = make_corpus(FLAGS.corpus_dir, FLAGS.text_gb, FLAGS.file_mb, FLAGS.group_rows,
                      FLAGS.seed, FLAGS.processes * max(FLAGS.workers, 1))
  if FLAGS.pid >= 0:
    pack_process(files)
    return
  shutil.rmtree(FLAGS.out, ignore_errors=True)
  sys.path.insert(0, os.path.join(REPO, "tests"))
  from gcs_emulator import free_port  # pylint: disable=import-outside-toplevel
  port = free_port()
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--pid={pid}",
                             f"--port={port}"] + sys.argv[1:], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
           for pid in range(FLAGS.processes)]
  reports = []
  for p in procs:
    out, _ = p.communicate()
    if p.returncode:
      sys.exit(f"error: packing process failed ({p.returncode})")
    reports += [json.loads(line[len("PROCESS "):]) for line in out.splitlines()
                if line.startswith("PROCESS ")]
  cores = FLAGS.processes * max(FLAGS.workers, 1)
  wall = max(r["wall_s"] for r in reports)
  tokens = reports[0]["tokens"]
  cpu = sum(r["cpu_s"] for r in reports)
  # per core from CPU time: on a shared box the wall clock counts other jobs' time too
  per_core, per_core_wall = tokens / cpu, tokens / wall / cores
  hours = TARGET_TOKENS / (per_core * FLAGS.host_cores * V5E16_HOSTS) / 3600
  text_bytes = sum(os.path.getsize(f) for f in files)
  result = {
      **prov,
      "text_gb": FLAGS.text_gb, "parquet_bytes": text_bytes, "tokens": tokens,
      "processes": FLAGS.processes, "workers": FLAGS.workers, "cores": cores, "wall_s": wall,
      "cpu_s": cpu, "tokens_per_s_per_core": per_core,
      "tokens_per_s_per_core_wall": per_core_wall, "load_avg": os.getloadavg(),
      "peak_rss_mb_process": max(r["rss_mb"] for r in reports),
      "peak_rss_mb_worker": max(r["worker_rss_mb"] for r in reports),
      "v5e16_10b_tokens_hours": hours, "host_cores": FLAGS.host_cores}
  print(f"{tokens / 1e6:.1f}M tokens in {wall:.1f} s wall, {cpu:.1f} CPU-s on {cores} "
        f"cores ({FLAGS.processes} processes x {max(FLAGS.workers, 1)} workers): "
        f"{per_core / 1e6:.3f}M tokens/s per core (CPU time; "
        f"{per_core_wall / 1e6:.3f}M by wall clock at load {os.getloadavg()[0]:.1f})")
  print(f"peak RSS: packing process {result['peak_rss_mb_process']:.0f} MB, worker "
        f"{result['peak_rss_mb_worker']:.0f} MB")
  print(f"10B tokens on a v5e-16 (4 hosts x {FLAGS.host_cores} cores): {hours * 60:.1f} min")
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  launcher.run(main)
