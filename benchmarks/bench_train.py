"""Training throughput, PRISM vs its dense twin and old code vs new, side by side in one run.

  python -m benchmarks.bench_train [--config=byte,small] [--baseline=/path/to/old/checkout]
      [--rounds=6] [--byte_steps=10] [--small_steps=1]

One worker process per code version (`--baseline`: a checkout of the old code, e.g.
`git worktree add /tmp/base <commit>`; this repository is the new code), each importing its
own `prism_jax` (PYTHONPATH = that checkout). Each worker builds the dense and the PRISM
train step of every config from the same seed (identical backbone; the real
`make_train_step`, state donated, the full PRISM objective), compiles and warms them up
(untimed), then the parent interleaves timed blocks across code versions and models
(old dense, new dense, new PRISM, old PRISM, then the reverse, ...), so load drift on a
shared machine hits all alike. Per block the worker measures wall and process CPU time
(user + system of all its threads: robust to other jobs sharing the cores) and minor page
faults (printed under the table: XLA:CPU's per-step buffers faulted in afresh were round
3's and 4's finding); reported
tokens/s = tokens per step / the median over blocks of the per-step time.
Configs run on random tokens (speed does not depend on the text): `byte` is issue 11's
byte-level config (4 layers / 4 heads / d 128 / ctx 64 / batch 12, K 512, k 8), timed with
two PRISM losses beside its one dense twin: `prism_paper` (the issue's measurement: the
paper's four terms) and `prism`, the tiny preset's loss (its faithfulness term, λ_proto_kl 1
since issue 11's second round, λ_proto 1 before, needs the prototype path's head W z_hat);
`small` GPT-2 124M with K 8192, k 16 at batch 1 x 256 (its preset's loss: no W z_hat),
`tiny` the tiny preset (16 x 128). Each PRISM row has its own analytic ratio, dense / PRISM
train FLOPs per token from prism_jax.flops for that row's loss (W z_hat counted where the
loss computes it).
"""

from __future__ import annotations

import dataclasses

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
from absl import flags

if __package__:  # python -m benchmarks.bench_train
  from benchmarks.configs import TRAIN as CONFIGS
else:  # run as a file: the --baseline worker (this folder is sys.path[0])
  from configs import TRAIN as CONFIGS  # pylint: disable=import-error

from prism_jax.cli import provenance

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This script's flags, defined when it runs (trace_train and sparse_backward_drift import
  its runner and define their own --config)."""
  flags.DEFINE_list("config", ["byte", "small"], "configs to benchmark (benchmarks/configs.py)")
  flags.DEFINE_string("baseline", None, "a checkout of the old code to time beside this one")
  flags.DEFINE_integer("rounds", 6, "timed blocks per (code, model, config)")
  flags.DEFINE_integer("byte_steps", 10, "steps per timed block at `byte` and `tiny`")
  flags.DEFINE_integer("small_steps", 1, "steps per timed block at `small`")
  flags.DEFINE_integer("warmup", 2, "untimed steps per model after compilation")
  flags.DEFINE_string("results_json", None, "also write the rows to this JSON file")
  flags.DEFINE_bool("worker", False, "internal: serve timing requests on stdin/stdout")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The models timed per config: the dense twin and PRISM variants (name -> loss overrides).
VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    # the paper's four loss terms (the measurement), and the tiny preset's loss, whose
    # faithfulness term (issue 11) adds the prototype path's head W z_hat. Spelled out, not
    # LossConfig.PROTO_LOGIT_TERMS: this module also drives an older checkout's library.
    "byte": {"prism_paper": ("loss.lambda_proto=0", "loss.lambda_proto_kl=0",
                             "loss.lambda_rlogit=0"), "prism": ()},
}


def kinds(name: str) -> tuple[str, ...]:
  """Models timed at config `name`: "dense", then its PRISM variants."""
  return ("dense",) + tuple(VARIANTS.get(name, {"prism": ()}))


def check_model(name: str, kind: str, *, prism_only: bool = False) -> None:
  """One error for a --config / --kind pair that is not a model `kinds(name)` times
  (`prism_only`: its PRISM variants)."""
  models = kinds(name) if name in CONFIGS else ()
  if kind not in (models[1:] if prism_only else models):
    raise ValueError(f"--config={name!r} --kind={kind!r}: choose a "
                     f"{'PRISM ' if prism_only else ''}model of bench_train's configs "
                     f"{sorted(CONFIGS)}")


def make_config(name: str, kind: str):
  """The Config of `name` for model `kind` (a `kinds` entry; random-init bank: no dense
  warm-up)."""
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  from prism_jax.config import LossConfig  # pylint: disable=g-import-not-at-top
  base, sets = CONFIGS[name]
  # A loss term switched off that an older checkout (--baseline) does not have is off there.
  known = {f"loss.{f.name}" for f in dataclasses.fields(LossConfig)}
  loss = [s for s in VARIANTS.get(name, {}).get(kind, ())
          if s.split("=")[0] in known or float(s.split("=")[1]) != 0]
  model = "dense" if kind == "dense" else "prism"
  return apply_overrides(preset(base), list(sets) + loss + [
      "model.proto_init=normal", f"model.kind={model}", "train.steps=100"])


def steps_per_block(name: str) -> int:
  return FLAGS.small_steps if name == "small" else FLAGS.byte_steps


class Runner:
  """One model's state and jitted train step; `block(n)` times n steps."""

  def __init__(self, cfg):
    import jax  # pylint: disable=g-import-not-at-top
    from prism_jax import sharding as shard_lib  # pylint: disable=g-import-not-at-top
    from prism_jax.train import create_train_state, default_mesh, make_optimizer, make_train_step  # pylint: disable=g-import-not-at-top
    self.jax, self.mesh = jax, default_mesh(cfg)
    tx = make_optimizer(cfg.train)
    with jax.set_mesh(self.mesh):
      graphdef, self.state, shardings = create_train_state(cfg, self.mesh, tx)
      self.step = make_train_step(graphdef, cfg, tx, shardings, self.mesh)
    batch, seq, vocab = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size
    toks = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    host = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": np.ones((batch, seq), bool)}
    sharding = shard_lib.batch_sharding(self.mesh)
    self.batch = {k: jax.device_put(v, sharding) for k, v in host.items()}
    self.loss = float("nan")

  def block(self, n: int) -> tuple[float, float]:
    """(wall s, CPU s) of n steps, waiting for the last; `self.faults`: their minor page
    faults (the whole process's, getrusage)."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    with self.jax.set_mesh(self.mesh):
      for _ in range(n):
        self.state, metrics = self.step(self.state, self.batch)
      self.loss = float(self.jax.device_get(metrics["loss"]))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return wall, cpu


def serve() -> None:
  """Worker: builds every (config, kind) runner, then answers "config kind n" lines."""
  runners = {}
  for name in FLAGS.config:
    for kind in kinds(name):
      runners[name, kind] = Runner(make_config(name, kind))
      runners[name, kind].block(FLAGS.warmup)  # compile + warm-up, untimed
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    name, kind, n = line.split()
    runner = runners[name, kind]
    wall, cpu = runner.block(int(n))
    print(json.dumps({"wall": wall, "cpu": cpu, "loss": runner.loss, "faults": runner.faults}),
          flush=True)


class Worker:
  """A subprocess running `serve` on the prism_jax of `checkout`."""

  def __init__(self, checkout: str, configs: list[str]):
    env = dict(os.environ, PYTHONPATH=checkout)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           f"--config={','.join(configs)}", f"--warmup={FLAGS.warmup}"]
    self.proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    self.checkout = checkout

  def read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the benchmark worker for {self.checkout} exited "
                         f"(code {self.proc.wait()}); see its log above")
    return json.loads(line)

  def time(self, name: str, kind: str, n: int) -> dict:
    self.proc.stdin.write(f"{name} {kind} {n}\n")
    self.proc.stdin.flush()
    return self.read()

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def analytic_ratio(name: str, kind: str) -> float:
  """dense / PRISM train FLOPs per token (prism_jax.flops) for PRISM variant `kind`'s loss."""
  from prism_jax.flops import flops_per_token  # pylint: disable=g-import-not-at-top
  cfgs = {k: make_config(name, k) for k in ("dense", kind)}
  seq = cfgs[kind].data.seq_len
  f = {k: flops_per_token(c.model, seq, c.loss)["train"] for k, c in cfgs.items()}
  return f["dense"] / f[kind]


def bench(configs: list[str]) -> list[dict]:
  codes = {"new": REPO}
  if FLAGS.baseline:
    codes = {"old": os.path.abspath(FLAGS.baseline), **codes}
  t0 = time.perf_counter()
  workers = {code: Worker(path, configs) for code, path in codes.items()}
  for w in workers.values():
    w.read()  # ready: compiled and warmed up
  print(f"workers ready (compile + warm-up {time.perf_counter() - t0:.0f} s, untimed)",
        flush=True)
  samples = {(name, c, k): [] for name in configs for c in codes for k in kinds(name)}
  losses, load = {}, []
  for name in configs:
    n = steps_per_block(name)
    order = [(c, k) for c in codes for k in kinds(name)]
    for r in range(FLAGS.rounds):
      # Alternate the order (A B C D, D C B A, ...): no slot always runs first or last.
      for c, k in (order if r % 2 == 0 else order[::-1]):
        res = workers[c].time(name, k, n)
        samples[name, c, k].append((res["wall"] / n, res["cpu"] / n, res["faults"] / n))
        losses[name, c, k] = res["loss"]
      load.append(os.getloadavg()[0])
      print(f"{name}: round {r + 1}/{FLAGS.rounds} (load average {load[-1]:.2f})", flush=True)
  for w in workers.values():
    w.close()
  print(f"1-min load average over the rounds: min {min(load):.2f}, median "
        f"{np.median(load):.2f}, max {max(load):.2f}", flush=True)
  rows = []
  for name in configs:
    for c in codes:
      rate, faults = {}, {}
      for k in kinds(name):
        cfg = make_config(name, k)
        tokens = cfg.train.batch_size * cfg.data.seq_len
        med = np.median(np.asarray(samples[name, c, k]), axis=0)
        rate[k] = {"wall": tokens / med[0], "cpu": tokens / med[1]}
        faults[k] = float(med[2])
      for k in kinds(name)[1:]:  # one row per PRISM variant, beside the shared dense twin
        cfg = make_config(name, k)
        rows.append(dict(
            config=name, variant=k, aux_head=cfg.loss.needs_proto_logits, code=c,
            batch=cfg.train.batch_size, seq_len=cfg.data.seq_len,
            steps=FLAGS.rounds * steps_per_block(name),
            dense_tok_s_wall=rate["dense"]["wall"], dense_tok_s_cpu=rate["dense"]["cpu"],
            prism_tok_s_wall=rate[k]["wall"], prism_tok_s_cpu=rate[k]["cpu"],
            ratio_wall=rate[k]["wall"] / rate["dense"]["wall"],
            ratio_cpu=rate[k]["cpu"] / rate["dense"]["cpu"], analytic=analytic_ratio(name, k),
            dense_loss=losses[name, c, "dense"], prism_loss=losses[name, c, k],
            dense_faults_per_step=faults["dense"], prism_faults_per_step=faults[k],
            load_avg_min_median_max=[min(load), float(np.median(load)), max(load)]))
  return rows


def format_table(rows: list[dict]) -> str:
  head = ("| config | W ẑ head | code | batch x seq | timed steps/model | dense tok/s wall / CPU"
          " | PRISM tok/s wall / CPU | PRISM/dense wall / CPU | analytic | "
          "dense new/old wall / CPU |")
  lines = [head, "|" + "---|" * 10]
  old = {(r["config"], r["variant"]): r for r in rows if r["code"] == "old"}
  for r in rows:
    speedup = "-"
    if r["code"] == "new" and (r["config"], r["variant"]) in old:
      o = old[r["config"], r["variant"]]
      speedup = (f"{r['dense_tok_s_wall'] / o['dense_tok_s_wall']:.2f}x / "
                 f"{r['dense_tok_s_cpu'] / o['dense_tok_s_cpu']:.2f}x")
    lines.append(
        f"| {r['config']} | {'yes' if r['aux_head'] else 'no'} | {r['code']} | {r['batch']} x "
        f"{r['seq_len']} | {r['steps']} | "
        f"{r['dense_tok_s_wall']:,.0f} / {r['dense_tok_s_cpu']:,.0f} | "
        f"{r['prism_tok_s_wall']:,.0f} / {r['prism_tok_s_cpu']:,.0f} | "
        f"{r['ratio_wall']:.3f} / {r['ratio_cpu']:.3f} | "
        f"{r['analytic']:.3f} | {speedup} |")
  lines.append("\nMinor page faults per step (median over blocks; the worker process's): " + "; ".join(
      f"{r['config']} {r['code']} dense {r['dense_faults_per_step']:,.0f}, {r['variant']} "
      f"{r['prism_faults_per_step']:,.0f}" for r in rows))
  return "\n".join(lines)


def check_flags() -> None:
  """Every flag combination, before any model is built (one `error:` line). Plain
  Python: the --baseline worker runs this file on an older checkout, without
  prism_jax/cli/flag_checks.py."""
  if not FLAGS.config:
    raise ValueError("--config is empty: give at least one config")
  for name in FLAGS.config:
    if name not in CONFIGS:
      raise ValueError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
  if FLAGS.baseline and not os.path.isdir(os.path.join(FLAGS.baseline, "prism_jax")):
    raise ValueError(f"--baseline={FLAGS.baseline!r} is not a checkout of prism_jax "
                     "(no prism_jax/ inside)")
  for name in ("rounds", "byte_steps", "small_steps"):
    if FLAGS[name].value < 1:
      raise ValueError(f"--{name} must be >= 1, got {FLAGS[name].value}")
  if FLAGS.warmup < 0:
    raise ValueError(f"--warmup must be >= 0, got {FLAGS.warmup}")
  if FLAGS.results_json and not os.path.isdir(os.path.dirname(os.path.abspath(
      FLAGS.results_json))):
    raise ValueError(f"--results_json={FLAGS.results_json}: its folder does not exist; "
                     "create it first")


def main(argv):
  del argv
  check_flags()
  if hasattr(launcher, "retain_freed_host_memory"):  # older checkouts' trainers set it
    launcher.retain_freed_host_memory()  # as the training command does on CPU
  if FLAGS.worker:
    serve()
    return
  rows = bench(list(FLAGS.config))
  print(format_table(rows))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, {"rows": rows}, "benchmarks.bench_train")


if __name__ == "__main__":
  define_flags()
  try:
    from prism_jax.cli import launcher  # pylint: disable=g-import-not-at-top
  except ImportError:  # the --baseline worker on a checkout older than prism_jax/cli
    from absl import app as launcher  # pylint: disable=g-import-not-at-top
  launcher.run(main)
