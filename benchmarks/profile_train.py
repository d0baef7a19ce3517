"""Where a train step's time goes: isolated jitted pieces of the dense and PRISM steps.

  python -m benchmarks.profile_train [--config=byte,small] [--reps=20]

Each piece is jitted alone and run forward + backward (the gradient of <out, c> for a
fixed random cotangent c, w.r.t. the piece's parameters and input) on the activations the
real model produces: embeddings, one attention / MLP / LayerNorm (times L), the tied LM
head + CE, the prototype layer and its parts (similarity matmul, top-k, column extrema of
R1, the mixture), the loss terms, and the optimiser update. The full train steps are timed
beside them; "rest" = step - sum of pieces (fusion across pieces, host dispatch).
Timing: per call, wall and process CPU time (user + system of all threads: robust to other
jobs on a shared box), medians over --reps calls after a warm-up.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

from benchmarks import configs
from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_list("config", ["byte", "small"], "configs to profile (benchmarks/configs.py)")
flags.DEFINE_integer("reps", 20, "timed calls per piece")
FLAGS = flags.FLAGS

# benchmarks/configs.py's TRAIN (byte: issue 11's byte-level config; small: GPT-2 124M with
# K 8192 at a CPU-sized batch 1 x 256), with profile_train's loss (PROFILE_LOSS).
CONFIGS = configs.TRAIN


def config(name: str, kind: str):
  return configs.train_config(name, list(configs.PROFILE_LOSS.get(name, ()))
                              + ["model.proto_init=normal", f"model.kind={kind}"])


def timed(fn, *args, reps: int) -> tuple[float, float]:
  """(median wall ms, median CPU ms) of `fn(*args)` after two warm-up calls."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  wall, cpu = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return 1e3 * float(np.median(wall)), 1e3 * float(np.median(cpu))


def fwd_bwd(module, call):
  """jit(grad of <call(module, x), c> w.r.t. (module params, x)) and its forward alone."""
  graphdef, params = nnx.split(module)

  def value(p, x, c):
    out = call(nnx.merge(graphdef, p), x)
    return sum(jnp.vdot(o, oc) for o, oc in zip(jax.tree.leaves(out), jax.tree.leaves(c)))

  return params, jax.jit(jax.grad(value, argnums=(0, 1), allow_int=True))


def cotangent(out, seed: int = 0):
  leaves, tree = jax.tree.flatten(out)
  rng = np.random.default_rng(seed)
  cts = [jnp.asarray(rng.standard_normal(x.shape), x.dtype)
         if jnp.issubdtype(x.dtype, jnp.floating) else None for x in leaves]
  return jax.tree.unflatten(tree, cts)


def float_leaves(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def piece(rows, name, module, call, x, times=1, reps=20):
  """Times fwd+bwd of `call(module, x)` (float outputs only) and appends a row."""
  only_float = lambda m, h: float_leaves(call(m, h))
  params, grad = fwd_bwd(module, only_float)
  ct = cotangent(only_float(module, x))
  wall, cpu = timed(grad, params, x, ct, reps=reps)
  rows.append((name, times, times * wall, times * cpu))


def _train_steps(rows, name: str, host: dict, reps: int) -> None:
  """Rows of the whole train step, dense and PRISM, on the config's mesh."""
  from prism_jax import sharding as shard_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.train import create_train_state, default_mesh, make_optimizer  # pylint: disable=g-import-not-at-top
  from prism_jax.train.step import make_train_step  # pylint: disable=g-import-not-at-top
  mesh = default_mesh(config(name, "prism"))
  for kind in ("dense", "prism"):
    kcfg = config(name, kind)
    tx = make_optimizer(kcfg.train)
    with jax.set_mesh(mesh):
      graphdef, state, shardings = create_train_state(kcfg, mesh, tx)
      step = make_train_step(graphdef, kcfg, tx, shardings, mesh)
      dev = {k: jax.device_put(v, shard_lib.batch_sharding(mesh)) for k, v in host.items()}
      holder = [state]

      def run(b, holder=holder, step=step):
        holder[0], m = step(holder[0], b)
        return m

      wall, cpu = timed(run, dev, reps=reps)
    rows.append((f"{kind} train step", 1, wall, cpu))


def _prototype_parts(rows, model, z_NxD, mc, reps: int) -> None:
  """Rows of the prototype layer's parts: similarity, top-k, R1's column extrema, mixture."""
  from prism_jax.model import prototypes as proto_lib  # pylint: disable=g-import-not-at-top
  p_KxD = model.bank.protos[...]
  sims = jax.jit(jax.grad(lambda zz, pp, c: jnp.vdot(proto_lib.similarity(zz, pp).cos_NxK, c),
                          argnums=(0, 1)))
  cos = proto_lib.similarity(z_NxD, p_KxD).cos_NxK
  c_cos = cotangent(cos)
  w, c = timed(sims, z_NxD, p_KxD, c_cos, reps=reps)
  rows.append(("  of which: similarity (N x K matmul + norms)", 1, w, c))
  topk = jax.jit(jax.grad(lambda s, cc: jnp.vdot(jax.lax.top_k(s, mc.k)[0], cc)))
  w, c = timed(topk, cos, cotangent(jax.lax.top_k(cos, mc.k)[0]), reps=reps)
  rows.append(("  of which: top-k (lax.top_k)", 1, w, c))
  colmax = jax.jit(jax.grad(lambda s, cc: jnp.vdot(proto_lib.first_max(s, 0), cc)))
  w, c = timed(colmax, cos, cotangent(proto_lib.first_max(cos, 0)), reps=reps)
  rows.append(("  of which: R1 column extrema (first_max over N)", 1, w, c))
  mix = jax.jit(jax.grad(lambda s, pp, cc: jnp.vdot(
      proto_lib.topk_mixture(s, pp, mc.k, mc.mixture).z_hat_NxD, cc), argnums=(0, 1)))
  w, c = timed(mix, cos, p_KxD, cotangent(z_NxD), reps=reps)
  rows.append(("  of which: top-k + mixture (gather k rows)", 1, w, c))


def _optimizer_row(rows, cfg, model, reps: int) -> None:
  """The optimizer update (clip + AdamW) over the model's parameters."""
  from prism_jax.train import make_optimizer  # pylint: disable=g-import-not-at-top
  tx = make_optimizer(cfg.train)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

  @jax.jit
  def update(g, o, p):
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

  w, c = timed(update, grads, opt_state, params, reps=reps)
  rows.append(("optimizer (clip + AdamW)", 1, w, c))


def profile(name: str, reps: int) -> list[tuple]:
  from prism_jax import losses  # pylint: disable=g-import-not-at-top
  from prism_jax.model.lm import build_model  # pylint: disable=g-import-not-at-top
  rows: list[tuple] = []
  cfg = config(name, "prism")
  mc, batch, seq = cfg.model, cfg.train.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  toks = rng.integers(0, mc.vocab_size, (batch, seq + 1), dtype=np.int32)
  host = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": np.ones((batch, seq), bool)}
  _train_steps(rows, name, host, reps)

  model = build_model(mc, seed=0)
  bb = model.backbone
  tokens = jnp.asarray(host["inputs"])
  pos = bb.positions(tokens)
  x = bb.embed(tokens, pos)
  piece(rows, "embed (wte + wpe gather)", bb, lambda m, t: m.embed(t, pos), tokens, reps=reps)
  blk = bb.blocks[0]
  piece(rows, "LayerNorm", blk.ln1, lambda m, h: m(h), x, times=2 * mc.n_layers + 1, reps=reps)
  piece(rows, "attention (qkv, scores, softmax, out)", blk.attn,
        lambda m, h: m(h, pos)[0], x, times=mc.n_layers, reps=reps)
  piece(rows, "MLP", blk.mlp, lambda m, h: m(h), x, times=mc.n_layers, reps=reps)
  z = bb(tokens)[0]
  targets = jnp.asarray(host["targets"]).reshape(-1)
  mask = jnp.ones(targets.shape, bool)
  ce = lambda m, h: losses.cross_entropy(m.lm_head(h).reshape(-1, mc.vocab_size), targets, mask)
  piece(rows, "LM head + CE", bb, ce, z, reps=reps)
  if cfg.loss.needs_proto_logits:  # W z_hat for λ_proto / λ_proto_kl / λ_rlogit
    piece(rows, "LM head + CE of W z_hat (λ_proto)", bb, ce, z, reps=reps)
  z_NxD = z.reshape(batch * seq, -1)
  piece(rows, "prototype layer (all of it)", model.bank, lambda m, h: m(h, mask), z_NxD,
        reps=reps)
  _prototype_parts(rows, model, z_NxD, mc, reps)
  _optimizer_row(rows, cfg, model, reps)
  return rows


def format_table(name: str, rows: list[tuple]) -> str:
  dense = next(r for r in rows if r[0] == "dense train step")
  prism = next(r for r in rows if r[0] == "prism train step")
  lines = [f"### {name}", "",
           "| piece (fwd + bwd) | x | wall ms | CPU ms | CPU % of dense step |",
           "|---|---|---|---|---|"]
  for label, times, wall, cpu in rows:
    lines.append(f"| {label} | {times} | {wall:.2f} | {cpu:.2f} | {100 * cpu / dense[3]:.1f}% |")
  backbone = sum(r[3] for r in rows if not r[0].startswith(("dense", "prism", "  ", "prototype",
                                                            "LM head + CE of")))
  lines.append(f"| rest of dense step (step - embed - LN - attn - MLP - head - opt) | | | "
               f"{dense[3] - backbone:.2f} | {100 * (dense[3] - backbone) / dense[3]:.1f}% |")
  lines.append(f"| PRISM step - dense step | | {prism[2] - dense[2]:.2f} | "
               f"{prism[3] - dense[3]:.2f} | {100 * (prism[3] - dense[3]) / dense[3]:.1f}% |")
  return "\n".join(lines)


def main(argv):
  del argv
  check.not_empty(config=FLAGS.config)
  for name in FLAGS.config:
    if name not in CONFIGS:
      raise ValueError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
  check.at_least(1, reps=FLAGS.reps)
  launcher.retain_freed_host_memory()  # as the training command does on CPU
  print(f"devices: {jax.devices()}")
  for name in FLAGS.config:
    print(format_table(name, profile(name, FLAGS.reps)), flush=True)


if __name__ == "__main__":
  launcher.run(main)
