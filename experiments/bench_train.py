"""Training throughput of PRISM vs its dense twin, measured side by side in one run.

  python -m experiments.bench_train [--presets=tiny,small] [--tiny_steps=120]
      [--small_steps=4 --small_batch=1 --small_seq_len=256] [--rounds=4]

Per preset: both models are built from the same seed (identical backbone), their jitted
train steps (prism_jax.train.make_train_step, state donated) are compiled and warmed up
(excluded from timing), then timed in alternating blocks (PRISM, dense, dense, PRISM, ...)
on the same pre-loaded batches, so load drift on a shared machine hits both alike. `tiny`
trains on the embedded corpus (packed under --workdir); `small` (GPT-2 124M, K=8192) runs a
few steps on random tokens (speed does not depend on the text) at a CPU-sized batch.
The PRISM step is the full objective with the prototype head (not the dense warm-up).
The analytic ratio comes from prism_jax.flops.flops_per_token (train FLOPs per token).
"""

import dataclasses
import time

import jax
import numpy as np
from absl import flags

from experiments import cli

flags.DEFINE_list("presets", ["tiny", "small"], "presets to benchmark")
flags.DEFINE_integer("tiny_steps", 120, "timed steps per model at `tiny`")
flags.DEFINE_integer("small_steps", 4, "timed steps per model at `small`")
flags.DEFINE_integer("small_batch", 1, "rows per step at `small`")
flags.DEFINE_integer("small_seq_len", 256, "tokens per row at `small`")
flags.DEFINE_integer("rounds", 4, "alternating timing blocks per model (steps split evenly)")
flags.DEFINE_integer("warmup", 2, "untimed steps per model after compilation")
flags.DEFINE_string("workdir", "/tmp/prism_bench_train", "where `tiny` packs its data")
FLAGS = flags.FLAGS


def preset_configs(name: str, batch: int | None, seq_len: int | None, steps: int):
  """(prism Config, dense Config) of a preset with the benchmark's batch and length."""
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  cfg = preset(name)
  seq_len = seq_len or cfg.data.seq_len
  cfg = dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len),
      train=dataclasses.replace(cfg.train, steps=max(steps + FLAGS.warmup, 10),
                                batch_size=batch or cfg.train.batch_size))
  dense = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kind="dense"))
  return cfg, dense


def load_batches(cfg, n: int, real_data: bool) -> list[dict[str, np.ndarray]]:
  """`n` training batches: the packed embedded corpus, or random tokens (speed only)."""
  if real_data:
    from prism_jax.train import prepare, default_mesh  # pylint: disable=g-import-not-at-top
    _, loader, _ = prepare(cfg, FLAGS.workdir, default_mesh(cfg))
    return [loader.batch_at(s) for s in range(n)]
  rng = np.random.default_rng(0)
  shape = (cfg.train.batch_size, cfg.data.seq_len)
  out = []
  for _ in range(n):
    toks = rng.integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1), dtype=np.int32)
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": np.ones(shape, bool)})
  return out


class Runner:
  """One model's sharded state and jitted train step; `run(batches)` times a block."""

  def __init__(self, cfg, mesh):
    from prism_jax import sharding as shard_lib  # pylint: disable=g-import-not-at-top
    from prism_jax.train import create_train_state, make_optimizer, make_train_step  # pylint: disable=g-import-not-at-top
    self.cfg, self.mesh = cfg, mesh
    tx = make_optimizer(cfg.train)
    with jax.set_mesh(mesh):
      graphdef, self.state, shardings = create_train_state(cfg, mesh, tx)
      self.step = make_train_step(graphdef, cfg, tx, shardings, mesh)
    self.sharding = shard_lib.batch_sharding(mesh)
    self.seconds, self.steps, self.last_loss = 0.0, 0, float("nan")

  def device_batches(self, batches):
    keys = ("inputs", "targets", "mask")
    return [{k: jax.device_put(b[k], self.sharding) for k in keys} for b in batches]

  def run(self, batches, timed: bool = True) -> None:
    t0 = time.perf_counter()
    with jax.set_mesh(self.mesh):
      for batch in batches:
        self.state, metrics = self.step(self.state, batch)
      loss = float(jax.device_get(metrics["loss"]))  # waits for the whole block
    if timed:
      self.seconds += time.perf_counter() - t0
      self.steps += len(batches)
    self.last_loss = loss


def bench_preset(name: str) -> dict:
  from prism_jax.flops import flops_per_token  # pylint: disable=g-import-not-at-top
  from prism_jax.train import default_mesh  # pylint: disable=g-import-not-at-top
  small = name != "tiny"
  steps = FLAGS.small_steps if small else FLAGS.tiny_steps
  cfg, dense_cfg = preset_configs(name, FLAGS.small_batch if small else None,
                                  FLAGS.small_seq_len if small else None, steps)
  mesh = default_mesh(cfg)
  batches = load_batches(cfg, FLAGS.warmup + steps, real_data=not small)
  t0 = time.perf_counter()
  runners = {"prism": Runner(cfg, mesh), "dense": Runner(dense_cfg, mesh)}
  dev = {k: r.device_batches(batches) for k, r in runners.items()}
  for k, r in runners.items():  # compile + warm-up, untimed
    r.run(dev[k][:FLAGS.warmup], timed=False)
  setup_s = time.perf_counter() - t0
  blocks = np.array_split(np.arange(FLAGS.warmup, FLAGS.warmup + steps), FLAGS.rounds)
  for i, block in enumerate(blocks):
    order = ("prism", "dense") if i % 2 == 0 else ("dense", "prism")
    for k in order:
      runners[k].run([dev[k][j] for j in block])
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  rate = {k: r.steps * tokens_per_step / r.seconds for k, r in runners.items()}
  flops = {k: flops_per_token(r.cfg.model, cfg.data.seq_len)["train"]
           for k, r in runners.items()}
  return dict(preset=name, batch=cfg.train.batch_size, seq_len=cfg.data.seq_len, steps=steps,
              prism_tok_s=rate["prism"], dense_tok_s=rate["dense"],
              ratio=rate["prism"] / rate["dense"],
              flop_ratio=flops["dense"] / flops["prism"],
              prism_loss=runners["prism"].last_loss, dense_loss=runners["dense"].last_loss,
              setup_s=setup_s)


def format_table(rows: list[dict]) -> str:
  head = ("| preset | batch x seq | timed steps/model | PRISM tok/s | dense tok/s | "
          "PRISM/dense tok/s | analytic dense/PRISM FLOPs | last loss PRISM / dense |")
  lines = [head, "|" + "---|" * 8]
  for r in rows:
    lines.append(f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {r['steps']} | "
                 f"{r['prism_tok_s']:,.0f} | {r['dense_tok_s']:,.0f} | {r['ratio']:.3f} | "
                 f"{r['flop_ratio']:.3f} | {r['prism_loss']:.3f} / {r['dense_loss']:.3f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  print(f"devices: {jax.devices()}")
  rows = []
  for name in FLAGS.presets:
    rows.append(bench_preset(name))
    print(f"{name}: done (compile + warm-up {rows[-1]['setup_s']:.0f} s, untimed)", flush=True)
  print(format_table(rows))


if __name__ == "__main__":
  cli.run(main)
