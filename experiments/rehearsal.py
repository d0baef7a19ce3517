"""CPU pod rehearsal: the path of a multi-host run, end to end, on this machine.

  python -m experiments.rehearsal [--config=small --steps=12 --proto_init_step=6
      --batch=8 --seq_len=128 --results_json=docs/results/rehearsal.json]    (make rehearsal)

The real model shape of --config (small: d 768, 12 layers, K 8192, k 16, GPT-2 BPE) and
its recipe (`preset(config, steps)`: learning rate, warm-up, decay, weight decay, loss,
checkpoint cadence), cut only where this box cannot afford it: --steps (bank set from data
at --proto_init_step, not the recipe's auto: a 12-step run has no evaluation to decide at), the global batch --batch and the
sequence length --seq_len, the data (every --corpus_stride-th document of the embedded
corpus, since the attribution cache covers every train row), one evaluation at the end
on --eval_batches val batches (not at the start and every 2%), checkpoints every
--ckpt_every steps keeping --keep_checkpoints (the emulator's bucket lies on disk under
--out). Stages, each timed:

  data       the embedded corpus written as parquet into gs:// (tests/gcs_emulator.py)
  reference  an uninterrupted run: --num_processes processes x --local_devices CPU
             devices, FSDP over all of them, workdir in gs://
  preempted  the same run in another workdir, SIGTERM to every process once step
             --sigterm_step has been logged
  resume     the same command again, to the end (evaluation at the end)
  cache      experiments.cache_multihost: the attribution cache built by every process
             vs one process, bit for bit
  report     prism report: prototype cards and the HTML report, from that cache

and checks: the bank was set from data, losses finite and falling (the mean of the last
third below the first third's), the resumed losses bit-for-bit the reference's, the cache
equal to the one-process build. Prints a table; --results_json records it (argv, commit).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import flags

from prism_jax.cli import flag_checks as check
from results_md.sources import REHEARSAL_CHECKS
from prism_jax.cli import launcher as cli
from prism_jax.cli import provenance

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET_ROOT = "gs://bucket/rehearsal"

flags.DEFINE_string("config", "small", "model preset (its shape and recipe)")
flags.DEFINE_integer("steps", 12, "train.steps (cut: the box's budget)")
flags.DEFINE_integer("proto_init_step", 6, "train.proto_init_step (cut with --steps)")
flags.DEFINE_integer("batch", 8, "train.batch_size, global rows (cut)")
flags.DEFINE_integer("corpus_stride", 6, "every n-th document of the embedded corpus (cut: the "
                     "attribution cache covers every train row, ~2 CPU-s per 128-token row "
                     "at `small`; 1: all 264 documents)")
flags.DEFINE_integer("seq_len", 128, "data.seq_len (cut)")
flags.DEFINE_integer("ckpt_every", 6, "train.ckpt_every (0: the recipe's for --steps)")
flags.DEFINE_integer("keep_checkpoints", 1, "train.keep_checkpoints (cut: every checkpoint "
                     "kept is ~1.5 GiB of the emulator's bucket at small)")
flags.DEFINE_integer("eval_batches", 2, "train.eval_batches (val batches per evaluation)")
flags.DEFINE_integer("sigterm_step", 9, "SIGTERM once this step is logged")
flags.DEFINE_integer("num_processes", 2, "processes (hosts)")
flags.DEFINE_integer("local_devices", 4, "CPU devices per process")
flags.DEFINE_list("set", [], "more config overrides KEY=VALUE, after the rehearsal's own")
flags.DEFINE_string("prompt", "The for statement", "the report's prompt")
flags.DEFINE_integer("max_new_tokens", 8, "tokens the report generates")
flags.DEFINE_integer("timeout", 3600, "seconds per stage")
flags.DEFINE_string("out", None, "local directory for logs (default: a temp dir)")
flags.DEFINE_string("results_json", None, "write the stage times and checks here")
FLAGS = flags.FLAGS


def _emulator():
  spec = importlib.util.spec_from_file_location(
      "gcs_emulator", os.path.join(REPO, "tests", "gcs_emulator.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def overrides() -> list[str]:
  """The recipe's settings this box cannot afford, then FSDP over every device."""
  return ([f"train.steps={FLAGS.steps}", f"train.proto_init_step={FLAGS.proto_init_step}",
           f"train.batch_size={FLAGS.batch}", f"data.seq_len={FLAGS.seq_len}",
           f"train.eval_every={FLAGS.steps}", "train.eval_at_start=false",
           f"train.eval_batches={FLAGS.eval_batches}", "train.log_every=1",
           f"train.keep_checkpoints={FLAGS.keep_checkpoints}"]
          + ([f"train.ckpt_every={FLAGS.ckpt_every}"] if FLAGS.ckpt_every else [])
          + ["mesh.data=1", "mesh.fsdp=-1", "mesh.model=1"] + list(FLAGS.set))


def _env(extra: dict) -> dict:
  """Every stage's environment: the emulator's and CPU devices per process. No persistent
  compilation cache: with one (JAX_COMPILATION_CACHE_DIR) a process reached the first
  collective of the preempted stage more than Gloo's 30 s rendezvous after the other and
  the run failed (load average 35); without it both compile, as in the reference."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(FLAGS.local_devices),
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
  for var in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
    env.pop(var, None)
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_procs(workdir: str, data: str, env: dict, logs: list[str]) -> list[subprocess.Popen]:
  """The train command on every process (jax.distributed on loopback), as a pod runs it."""
  port = _free_port()
  cmd = [sys.executable, "-m", "prism_jax.cli", "train", f"--config={FLAGS.config}",
         f"--workdir={workdir}", f"--data={data}", "--distributed=on",
         f"--coordinator_address=127.0.0.1:{port}",
         f"--num_processes={FLAGS.num_processes}"] + [f"--set={s}" for s in overrides()]
  return [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=REPO, env=env,
                           stdout=open(log, "w"), stderr=subprocess.STDOUT)
          for i, log in enumerate(logs)]


def wait_all(procs, logs, timeout) -> list[int]:
  deadline = time.time() + timeout
  codes = []
  for p, log in zip(procs, logs):
    try:
      codes.append(p.wait(timeout=max(1, deadline - time.time())))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise RuntimeError(f"timed out after {timeout} s; log {log}") from None
  return codes


def logged_step(log: str) -> int:
  """The last training step process 0's log reports (absl log line per step)."""
  with open(log, errors="replace") as f:
    steps = [int(s) for s in re.findall(r"\bstep (\d+)", f.read())]
  return max(steps, default=0)


def train_losses(workdir: str) -> dict[int, float]:
  from prism_jax import paths  # pylint: disable=import-outside-toplevel
  text = paths.path(workdir).joinpath("metrics.jsonl").read_text()
  recs = [json.loads(line) for line in text.splitlines() if line.strip()]
  return {r["step"]: r["loss"] for r in recs if r.get("split") == "train"}


def eval_metrics(workdir: str) -> dict:
  from prism_jax import paths  # pylint: disable=import-outside-toplevel
  text = paths.path(workdir).joinpath("metrics.jsonl").read_text()
  recs = [json.loads(line) for line in text.splitlines() if line.strip()]
  evals = [r for r in recs if r.get("split") == "val"]
  return evals[-1] if evals else {}


def write_corpus(path: str) -> int:
  """The embedded corpus (pydoc topics) as one parquet file with a `text` column."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from prism_jax import paths  # pylint: disable=import-outside-toplevel
  from prism_jax.data import sources  # pylint: disable=import-outside-toplevel
  texts = [doc.text for doc in sources.iter_documents(())][::FLAGS.corpus_stride]
  local = tempfile.mktemp(suffix=".parquet")
  pq.write_table(pa.table({"text": texts}), local, row_group_size=256)
  with open(local, "rb") as f:
    paths.path(path).write_bytes(f.read())
  os.remove(local)
  return len(texts)


class Stages:
  """Wall time per stage, printed as each ends."""

  def __init__(self):
    self.times: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, name: str):
    t0 = time.perf_counter()
    print(f"[{name}] ...", flush=True)
    yield
    self.times[name] = time.perf_counter() - t0
    print(f"[{name}] {self.times[name]:.0f} s", flush=True)


def _run(cmd: list[str], env: dict, log: str, timeout: int) -> str:
  with open(log, "w") as f:
    code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                          timeout=timeout, check=False).returncode
  text = open(log, errors="replace").read()
  if code != 0:
    raise RuntimeError(f"{' '.join(cmd[:3])} failed ({code}); log {log}:\n{text[-3000:]}")
  return text


def _preempt(run: str, data: str, env: dict, logs: list[str]) -> dict:
  """Train until --sigterm_step, SIGTERM every process: the step it was sent after, the
  exit codes and each process's saved step (all the same step: the agreed save)."""
  procs = train_procs(run, data, env, logs)
  deadline = time.time() + FLAGS.timeout
  while logged_step(logs[0]) < FLAGS.sigterm_step:
    if any(p.poll() is not None for p in procs) or time.time() > deadline:
      raise RuntimeError(f"the run ended before step {FLAGS.sigterm_step}; logs {logs}")
    time.sleep(0.5)
  checks = {"sigterm_after_step": logged_step(logs[0])}
  for p in procs:
    p.send_signal(signal.SIGTERM)
  checks["preempted_exit_codes"] = wait_all(procs, logs, 600)
  # each process prints `preempted by ...: saved step N ...` (prism_jax/cli/train.py)
  saved = [re.findall(r"preempted by [^\n]*?saved step (\d+)", open(log, errors="replace")
                      .read()) for log in logs]
  checks["preemption_saved_steps"] = [int(s[-1]) if s else None for s in saved]
  checks["preemption_same_step"] = (
      checks["preempted_exit_codes"] == [0] * len(logs) and None not in
      checks["preemption_saved_steps"] and len(set(checks["preemption_saved_steps"])) == 1)
  return checks


def _training_checks(ref: str, run: str, ref_log_path: str) -> dict:
  """The resumed run against the reference: losses finite and falling, bit-exact resume,
  the bank set from data at --proto_init_step, and the run's last evaluation."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  want, got = train_losses(ref), train_losses(run)
  checks: dict = {"losses": [want[s] for s in sorted(want)]}
  checks["losses_finite"] = bool(np.all(np.isfinite(checks["losses"])))
  third = max(1, len(want) // 3)
  checks["losses_falling"] = bool(np.mean(checks["losses"][-third:])
                                  < np.mean(checks["losses"][:third]))
  checks["resume_bit_exact"] = (sorted(got) == sorted(want) == list(range(1, FLAGS.steps + 1))
                                and all(np.float32(got[s]).tobytes()
                                        == np.float32(want[s]).tobytes() for s in want))
  ref_log = open(ref_log_path, errors="replace").read()
  m = re.search(r"step (\d+): prototypes set from (\d+) hidden states", ref_log)
  checks["bank_set_from_data"] = (m is not None and int(m.group(1)) == FLAGS.proto_init_step
                                  and int(m.group(2)) > 0)
  checks["bank_init"] = m.group(0) if m else None
  checks["eval"] = {k: v for k, v in eval_metrics(run).items()
                    if isinstance(v, (int, float))}
  return checks


def rehearse(out: str, env: dict) -> dict:
  stage = Stages()
  data = f"{BUCKET_ROOT}/data/corpus.parquet"
  ref, run = f"{BUCKET_ROOT}/reference", f"{BUCKET_ROOT}/run"
  n = FLAGS.num_processes
  logs = {k: [os.path.join(out, f"{k}_{i}.log") for i in range(n)]
          for k in ("reference", "preempted", "resume")}
  checks: dict = {}
  with stage("data"):
    checks["documents"] = write_corpus(data)
  with stage("reference"):
    codes = wait_all(train_procs(ref, data, env, logs["reference"]), logs["reference"],
                     FLAGS.timeout)
    if any(codes):
      raise RuntimeError(f"reference run failed {codes}; logs {logs['reference']}")
  with stage("preempted"):
    checks.update(_preempt(run, data, env, logs["preempted"]))
  with stage("resume"):
    codes = wait_all(train_procs(run, data, env, logs["resume"]), logs["resume"],
                     FLAGS.timeout)
    if any(codes):
      raise RuntimeError(f"resumed run failed {codes}; logs {logs['resume']}")
    resumed = re.findall(r"resumed from checkpoint (\d+)", open(logs["resume"][0]).read())
    checks["resumed_from"] = int(resumed[0]) if resumed else None
  checks.update(_training_checks(ref, run, logs["reference"][0]))
  with stage("cache"):
    cache_json = os.path.join(out, "cache_multihost.json")
    _run([sys.executable, "-m", "experiments.cache_multihost", f"--workdir={run}",
          f"--out={BUCKET_ROOT}/caches", f"--num_processes={n}",
          f"--local_devices={FLAGS.local_devices}", f"--stat_shards={max(8, n)}",
          f"--timeout={FLAGS.timeout}", f"--results_json={cache_json}"],
         env, os.path.join(out, "cache.log"), FLAGS.timeout)
    with open(cache_json) as f:
      cache = json.load(f)
    checks["cache_equal_one_process"] = bool(cache["equal_bit_for_bit"])
    checks["cache_tokens"] = cache["num_tokens"]
  with stage("report"):
    text = _run([sys.executable, "-m", "prism_jax.cli", "report", f"--workdir={run}",
                 f"--prompt={FLAGS.prompt}", f"--max_new_tokens={FLAGS.max_new_tokens}",
                 f"--cache_dir={BUCKET_ROOT}/caches/multi", f"--out={BUCKET_ROOT}/report",
                 "--detail_cards=64"],
                {**env, "JAX_NUM_CPU_DEVICES": "1"}, os.path.join(out, "report.log"),
                FLAGS.timeout)
    from prism_jax import paths  # pylint: disable=import-outside-toplevel
    page = paths.path(f"{BUCKET_ROOT}/report/index.html")
    checks["report_bytes"] = page.stat().length if page.exists() else 0
    checks["cards"] = paths.path(f"{run}/cards/cards.json").exists()
    checks["report_written"] = checks["report_bytes"] > 0 and checks["cards"]
    checks["report_log_tail"] = text.strip().splitlines()[-1:] if text.strip() else []
  return {"stages_s": {k: round(v, 1) for k, v in stage.times.items()}, "checks": checks}


PASS_KEYS = REHEARSAL_CHECKS
# The `small` rehearsal's peak, measured: the two cache-build processes (up to 8.7 GiB each
# at 4 devices). With the emulator's bucket in memory (7.2 GiB by then) a build process
# was OOM-killed on this 23 GiB box; the bucket is now on disk (under --out).
SMALL_PEAK_GIB = 18


def _warn_if_short_of_memory() -> None:
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    avail = int(info["MemAvailable"].split()[0]) / 2 ** 20
  except (OSError, KeyError, ValueError):
    return
  if FLAGS.config != "tiny" and avail < SMALL_PEAK_GIB:
    print(f"warning: {avail:.1f} GiB of memory available; the {FLAGS.config} rehearsal peaks "
          f"near {SMALL_PEAK_GIB} GiB (stop other jobs, or a process may be OOM-killed)",
          flush=True)


def check_flags() -> None:
  """Every flag combination, before the emulator or any process starts (one `error:`
  line): the stages run in child processes, whose failures would come as logs to read."""
  check.at_least(1, steps=FLAGS.steps, proto_init_step=FLAGS.proto_init_step,
                 batch=FLAGS.batch, corpus_stride=FLAGS.corpus_stride, seq_len=FLAGS.seq_len,
                 keep_checkpoints=FLAGS.keep_checkpoints, eval_batches=FLAGS.eval_batches,
                 sigterm_step=FLAGS.sigterm_step, num_processes=FLAGS.num_processes,
                 local_devices=FLAGS.local_devices, max_new_tokens=FLAGS.max_new_tokens,
                 timeout=FLAGS.timeout)
  check.at_least(0, ckpt_every=FLAGS.ckpt_every)
  if FLAGS.sigterm_step >= FLAGS.steps or FLAGS.proto_init_step >= FLAGS.steps:
    raise ValueError(f"--sigterm_step={FLAGS.sigterm_step} and --proto_init_step="
                     f"{FLAGS.proto_init_step} must be below --steps={FLAGS.steps}")
  check.output_file("results_json", FLAGS.results_json)
  # the config each train process builds, and the batch split over every device
  from prism_jax import sharding  # pylint: disable=import-outside-toplevel
  from prism_jax.config import resolve_config  # pylint: disable=import-outside-toplevel
  cfg = resolve_config(FLAGS.config, overrides())
  data, fsdp, _ = sharding.resolve_mesh_shape(cfg.mesh, FLAGS.num_processes
                                              * FLAGS.local_devices)
  if cfg.train.batch_size % (data * fsdp):
    raise ValueError(f"--batch={cfg.train.batch_size}: must be divisible by the data-parallel "
                     f"devices data*fsdp={data * fsdp} (--num_processes x --local_devices)")


def main(argv):
  del argv
  check_flags()
  out = FLAGS.out or tempfile.mkdtemp(prefix="rehearsal_")
  os.makedirs(out, exist_ok=True)
  print(f"logs in {out}", flush=True)
  _warn_if_short_of_memory()
  t0 = time.perf_counter()
  # the bucket on disk: in memory it grew past 7 GiB at `small` and, beside the two cache
  # build processes, got one OOM-killed
  with _emulator().running(data_dir=os.path.join(out, "bucket")) as gcs:
    result = rehearse(out, _env(gcs))
  result["total_s"] = round(time.perf_counter() - t0, 1)
  checks = result["checks"]
  print("\n| stage | wall s |\n| --- | --- |")
  for k, v in result["stages_s"].items():
    print(f"| {k} | {v:.0f} |")
  print(f"| total | {result['total_s']:.0f} |\n\n| check | result |\n| --- | --- |")
  for k in PASS_KEYS + ("resumed_from", "sigterm_after_step", "preemption_saved_steps",
                        "preempted_exit_codes", "cache_tokens", "report_bytes"):
    print(f"| {k} | {checks.get(k)} |")
  if FLAGS.results_json:
    data = dict(result, **provenance.record("experiments.rehearsal"), config=FLAGS.config,
                overrides=overrides(), num_processes=FLAGS.num_processes,
                local_devices=FLAGS.local_devices)
    provenance.write_results(FLAGS.results_json, data)
  failed = [k for k in PASS_KEYS if not checks.get(k)]
  if failed:
    raise SystemExit(f"error: rehearsal checks failed: {', '.join(failed)} (logs in {out})")
  print("rehearsal passed")


if __name__ == "__main__":
  cli.run(main)
