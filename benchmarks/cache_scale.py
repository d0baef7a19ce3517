"""Size and time model of the attribution cache at the paper's attribution setting.

  python -m benchmarks.cache_scale --out=/tmp/cache_scale [--config=small]
      [--seq_len=256] [--rows=16] [--ranks=16,64,256] [--results_json=docs/results/cache_scale.json]

Builds real caches (random-init model of --config, the embedded corpus, byte tokenizer,
the first --rows packed rows) at each rank, and prints one markdown table: bytes/token on
disk of the arrays that grow with the corpus (measured; and the record layout's
8 + 16k + 4r: example_id, offset, k ids, k activations, r floats of g, and the inverted
index's k token ids + k activations), the fixed statistics' size, the build's tokens/s on this host
(both passes, steady: the rank-0 build is timed after a warm-up build), and the projected
store size and host-hours for 0.5B and 10B training tokens (hosts x hours = tokens /
(tokens/s per host) / 3600; the build scales by hosts, cache_shards.py). Writes the table
as JSON to --results_json with the command.
"""

import dataclasses
import sys
import time

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
from prism_jax.cli import provenance

flags.DEFINE_string("out", "/tmp/cache_scale", "scratch directory written: data and caches "
                    "(local or gs://)")
flags.DEFINE_string("config", "small", "model preset name (small = the paper's 124M)")
flags.DEFINE_integer("seq_len", 256, "packed row length")
flags.DEFINE_integer("rows", 16, "training rows cached per build")
flags.DEFINE_list("ranks", ["16", "64", "256"], "cache ranks of g")
flags.DEFINE_string("results_json", None, "write the results to this JSON file "
                    "(docs/results/cache_scale.json)")
FLAGS = flags.FLAGS
CORPUS_TOKENS = (0.5e9, 10e9)
# Arrays that grow with the corpus (records + inverted index); the rest (A, G, μ, the
# eigenpairs, row_offsets) is a fixed cost of the model (K², D²) or per row.
PER_TOKEN = ("example_id", "offset", "idx", "act", "g", "proto_tokens", "proto_acts")


def _build(model, cfg, packed, out, cache_cfg):
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  cache = cache_lib.build_cache(model, cfg, packed, out, cache_cfg, overwrite=True,
                                progress=False)
  return cache, time.perf_counter() - t0


def main(argv):
  del argv
  check.at_least(1, seq_len=FLAGS.seq_len, rows=FLAGS.rows)
  check.not_empty(ranks=FLAGS.ranks)
  check.numbers("ranks", FLAGS.ranks, int, low=1)
  from prism_jax import config as cfg_lib  # pylint: disable=g-import-not-at-top
  from prism_jax import paths  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.model.lm import build_model  # pylint: disable=g-import-not-at-top
  base = cfg_lib.preset(FLAGS.config)
  cfg = dataclasses.replace(
      base, model=dataclasses.replace(base.model, max_len=FLAGS.seq_len),
      data=dataclasses.replace(base.data, seq_len=FLAGS.seq_len, tokenizer="byte",
                               val_fraction=0.0))
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.out)
  model = build_model(cfg.model, 0)
  mcfg = cfg.model
  rows = []
  warm = cache_lib.CacheConfig(rank=int(FLAGS.ranks[0]), max_rows=FLAGS.rows, batch_rows=8)
  _build(model, cfg, packed, paths.join(FLAGS.out, "warmup"), warm)  # compiles
  for rank in map(int, FLAGS.ranks):
    cc = dataclasses.replace(warm, rank=rank)
    cache, seconds = _build(model, cfg, packed, paths.join(FLAGS.out, f"r{rank}"), cc)
    tok_s = cache.num_tokens / seconds
    per_token = sum(paths.tree_bytes(paths.join(cache.path, n)) for n in PER_TOKEN)
    row = {"rank": rank, "record_bytes_per_token": round(per_token / cache.num_tokens, 1),
           "layout_bytes_per_token": 8 + 16 * mcfg.k + 4 * rank,
           "fixed_stats_MB": round((paths.tree_bytes(cache.path) - per_token) / 1e6, 2),
           "build_tokens_per_s_per_host": round(tok_s, 1), "tokens_built": cache.num_tokens}
    for n in CORPUS_TOKENS:
      tag = f"{n / 1e9:g}B"
      row[f"store_GB_{tag}"] = round(n * row["layout_bytes_per_token"] / 1e9, 1)
      row[f"host_hours_{tag}"] = round(n / tok_s / 3600, 1)
    rows.append(row)
    print(f"rank {rank}: {cache.num_tokens} tokens in {seconds:.1f} s", file=sys.stderr)
  keys = list(rows[0])
  print(f"\nmodel {FLAGS.config}: d {mcfg.d_model}, K {mcfg.num_prototypes}, k {mcfg.k}, "
        f"T {FLAGS.seq_len}; {FLAGS.rows} rows per build\n")
  print("| " + " | ".join(keys) + " |")
  print("|" + "---|" * len(keys))
  for r in rows:
    print("| " + " | ".join(f"{r[k]:,}" if isinstance(r[k], (int, float)) else str(r[k])
                            for k in keys) + " |")
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, {
        "model": {"preset": FLAGS.config, "d_model": mcfg.d_model,
                  "K": mcfg.num_prototypes, "k": mcfg.k, "seq_len": FLAGS.seq_len},
        "rows": rows}, "benchmarks.cache_scale")


if __name__ == "__main__":
  launcher.run(main)
