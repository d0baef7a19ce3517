"""The README's multi-host cache build as commands: P processes of `prism attribute`
--build_only on this machine (jax.distributed on loopback) vs one process, bit for bit.

  python -m experiments.cache_multihost --workdir=RUN --out=DIR [--num_processes=2]
      [--local_devices=4] [--stat_shards=8] [--results_json=docs/results/cache_multihost.json]

RUN is a trained PRISM run (local or gs://: with an emulator, STORAGE_EMULATOR_HOST and
TENSORSTORE_GCS_HTTP_URL as tests/gcs_emulator.py sets them); DIR receives the caches
`one` and `multi`. Every process runs exactly the command a host of a pod would
(`--distributed=on --coordinator_address=... --num_processes=P --process_id=i`). Prints a
table: wall time, tokens, tokens/s per process, and whether every array and the metadata
of the two caches are equal.
"""

import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
from prism_jax.cli import provenance

flags.DEFINE_string("workdir", None, "trained PRISM run (local or gs://)")
flags.DEFINE_string("out", None, "where the two caches go (local or gs://)")
flags.DEFINE_integer("num_processes", 2, "processes of the multi-process build")
flags.DEFINE_integer("local_devices", 4, "CPU devices per process")
flags.DEFINE_integer("stat_shards", 8, "cache.stat_shards (>= num_processes)")
flags.DEFINE_integer("timeout", 1200, "seconds per build")
flags.DEFINE_string("results_json", None, "write the results JSON to this file")
flags.mark_flags_as_required(["workdir", "out"])
FLAGS = flags.FLAGS


def _attribute_cmd(cache_dir, extra):
  return [sys.executable, "-m", "prism_jax.cli", "attribute", f"--workdir={FLAGS.workdir}",
          f"--cache_dir={cache_dir}", "--build_only", "--rebuild",
          f"--stat_shards={FLAGS.stat_shards}"] + extra


def _build(cache_dir, count, log_dir):
  """Wall seconds of a build by `count` processes (each its own log)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(FLAGS.local_devices))
  for var in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):  # as experiments/rehearsal.py
    env.pop(var, None)
  if count == 1:
    cmds = [_attribute_cmd(cache_dir, ["--distributed=off"])]
  else:
    import socket  # pylint: disable=g-import-not-at-top
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    cmds = [_attribute_cmd(cache_dir, ["--distributed=on",
                                       f"--coordinator_address=127.0.0.1:{port}",
                                       f"--num_processes={count}", f"--process_id={i}"])
            for i in range(count)]
  t0 = time.perf_counter()
  logs = [os.path.join(log_dir, f"build{count}_{i}.log") for i in range(len(cmds))]
  procs = [subprocess.Popen(c, env=env, stdout=open(l, "w"), stderr=subprocess.STDOUT)
           for c, l in zip(cmds, logs)]
  for p, l in zip(procs, logs):
    if p.wait(timeout=FLAGS.timeout) != 0:
      for q in procs:
        q.kill()
      raise RuntimeError(f"a build process failed; its log {l}:\n"
                         + open(l).read()[-3000:])
  print(open(logs[0]).read().strip().splitlines()[-1])  # process 0's size line
  return time.perf_counter() - t0


def _read_all(path):
  from prism_jax import paths  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache_format as fmt  # pylint: disable=g-import-not-at-top
  meta = fmt.read_json(paths.join(path, fmt.METADATA))
  meta.pop("build_seconds_last_run")
  drv = meta["identity"]["cache"]["driver"]
  arrays = {p.name: fmt.store(path, p.name, drv).read().result()
            for p in paths.path(path).iterdir() if p.is_dir()}
  return arrays, meta


def _differences(one, meta_one, multi, meta_multi) -> list[str]:
  """What differs between the two caches, one line each: an array's name, shape and its
  first differing flat index, or a metadata key (empty: equal bit for bit)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = [f"array {n} only in the {'1' if n in one else 'multi'}-process cache"
         for n in sorted(set(one) ^ set(multi))]
  for n in sorted(set(one) & set(multi)):
    a, b = one[n], multi[n]
    if a.shape != b.shape:
      out.append(f"array {n}: shape {a.shape} vs {b.shape}")
    elif a.tobytes() != b.tobytes():
      flat_a, flat_b = a.reshape(-1), b.reshape(-1)
      bad = np.flatnonzero(flat_a != flat_b)
      if a.dtype.kind == "f":  # NaN at the same place is no difference of value
        bad = bad[~(np.isnan(flat_a[bad]) & np.isnan(flat_b[bad]))]
      where = f"{bad.size} of {a.size} entries, first at flat index {bad[0]}" if bad.size \
          else "same values, other bits (e.g. -0.0 or NaN payloads)"
      out.append(f"array {n} {a.dtype}{list(a.shape)}: {where}")
  for key in sorted(set(meta_one) | set(meta_multi)):
    if meta_one.get(key) != meta_multi.get(key):
      out.append(f"metadata {key!r}: {meta_one.get(key)!r} vs {meta_multi.get(key)!r}"[:300])
  return out


def check_flags() -> None:
  """Every flag combination, before any build (one `error:` line)."""
  if FLAGS.num_processes < 2:
    raise ValueError(f"--num_processes={FLAGS.num_processes}: compare at least 2 with 1")
  check.at_least(1, local_devices=FLAGS.local_devices, timeout=FLAGS.timeout)
  if FLAGS.stat_shards < FLAGS.num_processes:
    raise ValueError(f"--stat_shards={FLAGS.stat_shards}: give at least --num_processes="
                     f"{FLAGS.num_processes} (cache.stat_shards >= the process count)")
  check.existing("workdir", FLAGS.workdir, "run directory")
  check.output_file("results_json", FLAGS.results_json)


def main(argv):
  del argv
  check_flags()
  from prism_jax import paths  # pylint: disable=g-import-not-at-top
  log_dir = tempfile.mkdtemp(prefix="cache_multihost_")  # each process's log
  print(f"build logs in {log_dir}")
  rows = []
  for count, name in ((1, "one"), (FLAGS.num_processes, "multi")):
    wall = _build(paths.join(FLAGS.out, name), count, log_dir)
    rows.append({"processes": count, "wall_s": wall})
  (one, meta_one), (multi, meta_multi) = (_read_all(paths.join(FLAGS.out, n))
                                          for n in ("one", "multi"))
  differing = _differences(one, meta_one, multi, meta_multi)
  equal = not differing
  tokens = int(meta_one["sizes"]["num_tokens"])
  print(f"\n{tokens} tokens; devices per process {FLAGS.local_devices}\n")
  print("| processes | build wall s (incl. start-up) | tokens/s per process | cache equal to "
        "the 1-process build |\n| --- | --- | --- | --- |")
  for r in rows:
    r["tokens_per_s_per_process"] = tokens / r["wall_s"] / r["processes"]
    print(f"| {r['processes']} | {r['wall_s']:.1f} | {r['tokens_per_s_per_process']:.0f} | "
          f"{'bit for bit (' + str(len(one)) + ' arrays + metadata)' if equal else 'NO'} |")
  if FLAGS.results_json:  # experiments/reproduce.py's schema: one row, the builds as detail
    rec = provenance.record("experiments.cache_multihost")
    command = rec["command"]
    row = {"metric": f"attribution cache built by {FLAGS.num_processes} processes vs 1",
           "paper": "not reported", "command": command,
           "ours": (f"bit for bit ({len(one)} arrays + metadata)" if equal else "differs"),
           "note": f"{tokens} tokens, {FLAGS.local_devices} CPU devices per process"}
    provenance.write_results(FLAGS.results_json, {
        "rows": [row], **rec, "num_tokens": tokens, "equal_bit_for_bit": bool(equal),
        "builds": rows, "arrays": sorted(one), "differing": differing})
  if not equal:
    raise SystemExit("error: the multi-process cache differs from the 1-process cache: "
                     + "; ".join(differing))


if __name__ == "__main__":
  launcher.run(main)
