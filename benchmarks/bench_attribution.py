"""Cached PRISM attribution vs the full prototype-space reference vs EK-FAC, side by side.

  python -m benchmarks.bench_attribution --workdir=/tmp/attr_run [--train_steps=300]
      [--queries=16] [--rank=32] [--max_rows=0]

Trains a tiny PRISM on the embedded corpus if --workdir has no checkpoint, then runs every
method in its own process (peak RSS = that process's ru_maxrss): the cache build, cached
PRISM queries (influence.attribute_batch: the query forwards in one compiled call, then
each query scored; per-query time = the batch's time / #queries, fastest of 3 rounds), the
full prototype-space reference, EK-FAC factor fitting, and EK-FAC scoring with its
query/train batch sizes halved in turn until its peak RSS is at or below PRISM's (EK-FAC
streams layer groups, see ekfac.ekfac_scores), and a bare process that only loads the same
imports, model and data (the floor every method's RSS includes). Queries
are single next-token predictions at random positions of validation rows; training
sequences are packed rows (--unit). Prints one table (markdown), writes results JSON to --out.
"""

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher, provenance

flags.DEFINE_string("workdir", "/tmp/prism_attr_bench", "trained tiny run (trained if absent)")
flags.DEFINE_string("out", None, "scratch + results (default <workdir>/bench_attribution)")
flags.DEFINE_integer("train_steps", 300, "steps if the run must be trained first")
flags.DEFINE_integer("queries", 16, "query tokens")
flags.DEFINE_integer("rank", 32, "cache projection rank of g (d_model = exact)")
flags.DEFINE_integer("max_rows", 0, "training rows attributed over (0 = all)")
flags.DEFINE_integer("seed", 0, "query sampling")
flags.DEFINE_enum("unit", "row", ["row", "document"], "a training sequence: packed row "
                  "(kronfluence's example) or document")
flags.DEFINE_list("sweep_ranks", ["16", "64", "128"], "extra cache ranks: retention vs rank")
flags.DEFINE_string("suffix", "", "internal: cache / result name suffix (rank sweep)")
flags.DEFINE_bool("reuse", False, "skip methods whose result JSON is already in --out")
flags.DEFINE_string("method", None, "internal: run one method in this process")
flags.DEFINE_integer("qbs", 0, "internal: EK-FAC query batch size")
flags.DEFINE_integer("tbs", 0, "internal: EK-FAC train batch rows")
flags.DEFINE_integer("prism_query_batch", 0, "cached PRISM: queries per attribute_batch "
                     "forward call (0 = all queries in one call)")
FLAGS = flags.FLAGS


def _rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _load(out_dir):
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  model, cfg, _ = load_for_inference(FLAGS.workdir)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  with open(os.path.join(out_dir, "queries.json")) as f:
    queries = json.load(f)
  return model, cfg, packed, queries


def _max_rows(packed):
  return FLAGS.max_rows or packed.num_rows("train")


def _prism_method(model, cfg, cache_dir, q_tokens, out_dir, tag) -> dict:
  """Cached PRISM: the fastest of 3 rounds per query (scores saved as <tag>.npz)."""
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.scoring import influence  # pylint: disable=g-import-not-at-top
  cache = cache_lib.AttributionCache(cache_dir, model, cfg)
  icfg = influence.InfluenceConfig(unit=FLAGS.unit)
  pre = influence.Preconditioner(cache, icfg, model)
  qs = [(tok, [len(tok) - 1]) for tok in q_tokens]
  qb = FLAGS.prism_query_batch or len(qs)
  run = lambda: influence.attribute_batch(model, cache, qs, precond=pre, cfg=icfg,
                                          batch_size=qb)
  run()  # compiles the forward for the batch buckets used
  rounds, cpu = [], []
  for _ in range(3):  # the fastest of 3 rounds: the machine may be shared
    t, c = time.time(), time.process_time()
    atts = run()
    rounds.append((time.time() - t) / len(qs))
    cpu.append((time.process_time() - c) / len(qs))
  np.savez(os.path.join(out_dir, f"{tag}.npz"), *[np.stack([a.all_ids, a.all_scores])
                                                 for a in atts])
  return dict(per_query_s=min(rounds), per_query_cpu_s=min(cpu), query_batch=qb,
              rounds_s=rounds, rounds_cpu_s=cpu)


def _full_method(model, cfg, packed, cache_dir, q_tokens, out_dir, tag) -> dict:
  """Full prototype-space scores (linear or full path, by FLAGS.method)."""
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.scoring import influence  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.scoring import influence_full  # pylint: disable=g-import-not-at-top
  cache = cache_lib.AttributionCache(cache_dir, model, cfg)
  path = "linear" if FLAGS.method == "full_linear" else "full"
  qs = [(tok, [len(tok) - 1]) for tok in q_tokens]
  icfg = influence.InfluenceConfig(unit=FLAGS.unit)
  influence_full.full_scores(model, cache, packed, qs, path=path, max_rows=2, cfg=icfg)  # warm
  t = time.time()
  ids, sc = influence_full.full_scores(model, cache, packed, qs, path=path, cfg=icfg)
  np.savez(os.path.join(out_dir, f"{tag}.npz"), ids=ids, scores=sc)
  return {"per_query_s": (time.time() - t) / len(qs)}


def _ekfac_fit_method(model, packed, out_dir) -> dict:
  """EK-FAC's factors, fitted over the training rows (saved as ekfac_factors.npz)."""
  from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.hessians import ekfac  # pylint: disable=g-import-not-at-top
  t = time.time()
  batches = lambda: (b for _, b in cache_format.iter_rows(packed, "train", 16, 0,
                                                       _max_rows(packed)))
  factors = ekfac.fit_factors(model, batches(), lambda_batches=batches())
  res = {"fit_seconds": time.time() - t}
  flat = {f"{kind}/{n}": np.asarray(getattr(factors, kind)[n])
          for kind in ("q_a", "q_s", "lam", "damping") for n in factors.q_a}
  np.savez(os.path.join(out_dir, "ekfac_factors.npz"), **flat)
  return res


def _ekfac_method(model, packed, rows, queries, out_dir) -> dict:
  """EK-FAC scores at query batch --qbs and train batch --tbs, from the fitted factors."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache_format  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.hessians import ekfac  # pylint: disable=g-import-not-at-top
  with np.load(os.path.join(out_dir, "ekfac_factors.npz")) as f:
    parts = {k: jnp.asarray(f[k]) for k in f.files}
  names = ekfac.layer_names(model)
  factors = ekfac.Factors(*[{n: parts[f"{kind}/{n}"] for n in names}
                            for kind in ("q_a", "q_s", "lam", "damping")], 0, 0)
  t_len = packed.seq_len
  query = {"inputs": np.stack([rows[r, :-1] for r, _ in queries]),
           "targets": np.stack([rows[r, 1:] for r, _ in queries]),
           "mask": np.zeros((len(queries), t_len), bool)}
  for q, (_, p) in enumerate(queries):
    query["mask"][q, p - 1] = True
  batches = lambda: (b for _, b in cache_format.iter_rows(packed, "train", FLAGS.tbs, 0,
                                                       _max_rows(packed)))
  small = {k: v[:FLAGS.qbs] for k, v in query.items()}
  # Warm-up compiles; layer groups are streamed (ekfac_scores' default `layerwise`).
  ekfac.ekfac_scores(model, factors, small, lambda: (b for _, b in cache_format.iter_rows(
      packed, "train", FLAGS.tbs, 0, 2 * FLAGS.tbs)), query_batch_size=FLAGS.qbs,
                     train_batch_size=FLAGS.tbs, by_example=FLAGS.unit == "document")
  # Every query chunk streams the whole training set once, so one chunk's time / its size
  # is the per-query time; only the first try (all queries in one chunk) keeps scores.
  first = FLAGS.qbs >= len(queries)
  t, c = time.time(), time.process_time()
  sc, ids = ekfac.ekfac_scores(model, factors, query if first else small, batches,
                               query_batch_size=FLAGS.qbs, train_batch_size=FLAGS.tbs,
                               by_example=FLAGS.unit == "document")
  res = dict(per_query_s=(time.time() - t) / sc.shape[0], qbs=FLAGS.qbs, tbs=FLAGS.tbs,
             per_query_cpu_s=(time.process_time() - c) / sc.shape[0])
  if first:
    np.savez(os.path.join(out_dir, "ekfac.npz"), ids=ids, scores=sc)
  return res


def _worker(out_dir):
  """Runs FLAGS.method; writes <method>.json (+ scores .npz)."""
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  model, cfg, packed, queries = _load(out_dir)
  cache_dir = os.path.join(out_dir, "cache" + FLAGS.suffix)
  rows = packed.rows("val")["tokens"]
  q_tokens = [np.asarray(rows[r, :p + 1]) for r, p in queries]
  res, tag = {"method": FLAGS.method}, FLAGS.method + FLAGS.suffix
  if FLAGS.method == "baseline":  # same imports, model and data as every method, no work
    res["per_query_s"] = float("nan")
  elif FLAGS.method == "build":
    t = time.time()
    cache = cache_lib.build_cache(model, cfg, packed, cache_dir, cache_lib.CacheConfig(
        rank=FLAGS.rank, max_rows=_max_rows(packed)), overwrite=True)
    res.update(seconds=time.time() - t, tokens=cache.num_tokens,
               bytes_per_token=cache.nbytes_per_token())
  elif FLAGS.method == "prism":
    res.update(_prism_method(model, cfg, cache_dir, q_tokens, out_dir, tag))
  elif FLAGS.method in ("full_linear", "full"):
    res.update(_full_method(model, cfg, packed, cache_dir, q_tokens, out_dir, tag))
  elif FLAGS.method == "ekfac_fit":
    res.update(_ekfac_fit_method(model, packed, out_dir))
  elif FLAGS.method == "ekfac":
    res.update(_ekfac_method(model, packed, rows, queries, out_dir))
    tag = f"ekfac_q{FLAGS.qbs}_t{FLAGS.tbs}"
  res["peak_rss_bytes"] = _rss_bytes()
  provenance.write_json(os.path.join(out_dir, f"{tag}.json"), res)


def _run(out_dir, method, **extra):
  tag = (method + extra.get("suffix", "") if method != "ekfac" else
         f"ekfac_q{extra['qbs']}_t{extra['tbs']}")
  if FLAGS.reuse and os.path.exists(os.path.join(out_dir, f"{tag}.json")):
    with open(os.path.join(out_dir, f"{tag}.json")) as f:
      return json.load(f)
  args = [sys.executable, "-m", "benchmarks.bench_attribution", f"--workdir={FLAGS.workdir}",
          f"--out={out_dir}", f"--method={method}",
          f"--max_rows={FLAGS.max_rows}", f"--unit={FLAGS.unit}",
          f"--prism_query_batch={FLAGS.prism_query_batch}"]
  args += [f"--{k}={v}" for k, v in dict(dict(rank=FLAGS.rank), **extra).items()]
  subprocess.run(args, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  with open(os.path.join(out_dir, f"{tag}.json")) as f:
    return json.load(f)


def _ensure_trained():
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides, train  # pylint: disable=g-import-not-at-top
  if os.path.isdir(os.path.join(FLAGS.workdir, "checkpoints")):
    return
  cfg = apply_overrides(preset("tiny"), [f"train.steps={FLAGS.train_steps}"])
  train(cfg, FLAGS.workdir)


def _per_query_rankings(out_dir, name, num_q):
  if name.startswith("prism"):
    with np.load(os.path.join(out_dir, f"{name}.npz")) as f:
      return [(f[f"arr_{q}"][0].astype(np.int64), f[f"arr_{q}"][1]) for q in range(num_q)]
  with np.load(os.path.join(out_dir, f"{name}.npz")) as f:
    return [(f["ids"], f["scores"][q]) for q in range(num_q)]


METHODS = ("baseline", "build", "prism", "full_linear", "full", "ekfac_fit", "ekfac")


def check_flags() -> None:
  """Every flag combination, before training, data or any method runs (one `error:`
  line): the rank sweep is read at the end, after every other method."""
  check.at_least(1, train_steps=FLAGS.train_steps, queries=FLAGS.queries, rank=FLAGS.rank)
  check.at_least(0, max_rows=FLAGS.max_rows, prism_query_batch=FLAGS.prism_query_batch)
  check.numbers("sweep_ranks", FLAGS.sweep_ranks, int, low=1)
  if FLAGS.method is not None:
    check.known("method", [FLAGS.method], METHODS)
    if FLAGS.method == "ekfac":
      check.at_least(1, qbs=FLAGS.qbs, tbs=FLAGS.tbs)


def _sample_queries(out_dir, packed) -> list[tuple[int, int]]:
  """--queries (val row, target column) pairs with a real prediction, seeded; with --reuse
  the ones saved in <out>/queries.json; saved there for the method processes."""
  rng = np.random.default_rng(FLAGS.seed)
  offs = packed.rows("val")["offset"]
  queries = []
  for r in rng.permutation(packed.num_rows("val"))[:FLAGS.queries]:
    valid = np.flatnonzero(offs[r, 1:] > 0) + 1  # target columns with a real prediction
    queries.append((int(r), int(rng.choice(valid))))
  q_path = os.path.join(out_dir, "queries.json")
  if FLAGS.reuse and os.path.exists(q_path):
    with open(q_path) as f:
      queries = [tuple(q) for q in json.load(f)]
  provenance.write_json(q_path, queries)
  return queries


def _ekfac_within(out_dir, num_queries: int, prism: dict) -> tuple[dict, list[dict]]:
  """EK-FAC at the largest batches whose peak RSS is at most PRISM's: the last try, and all.
  Halves the query batch and the train batch in turn (query first: its preconditioned
  gradients, qbs × #params, dominate EK-FAC's memory)."""
  qbs, tbs, tried = num_queries, 16, []
  while True:
    ek = _run(out_dir, "ekfac", qbs=qbs, tbs=tbs)
    tried.append(ek)
    if ek["peak_rss_bytes"] <= prism["peak_rss_bytes"] or (qbs == 1 and tbs == 1):
      return ek, tried
    if qbs > 1 and (qbs >= tbs or tbs == 1):
      qbs //= 2
    else:
      tbs //= 2


def _speed_lines(res: dict, tried: list[dict]) -> list[str]:
  """The per-query time and memory table of every method, and the EK-FAC tries."""
  prism, full_lin, full, ek = res["prism"], res["full_linear"], res["full"], res["ekfac"]
  build, fit = res["build"], res["ekfac_fit"]
  mib = lambda b: b / 2 ** 20
  lines = ["", "| method | per-query s | per-query CPU s | peak RSS MiB | speed-up vs EK-FAC "
           "(wall) | speed-up vs EK-FAC (CPU) |", "|---|---|---|---|---|---|"]
  cpu = lambda r: r.get("per_query_cpu_s")
  for name, r in ((f"cached PRISM (query batch {prism.get('query_batch', 1)})", prism),
                  ("full prototype-space (linear)", full_lin),
                  ("full prototype-space (full path)", full), (
                      f"EK-FAC (query batch {ek['qbs']}, train batch {ek['tbs']})", ek)):
    cpu_cols = (f"{cpu(r):.4g}", f"{cpu(ek) / cpu(r):.1f}×") if cpu(r) and cpu(ek) else \
        ("–", "–")
    lines.append(f"| {name} | {r['per_query_s']:.4g} | {cpu_cols[0]} | "
                 f"{mib(r['peak_rss_bytes']):.0f} | {ek['per_query_s'] / r['per_query_s']:.1f}× "
                 f"| {cpu_cols[1]} |")
  lines.append(f"| (bare process: imports + model + data, no work) | – | – | "
               f"{mib(res['baseline']['peak_rss_bytes']):.0f} | – | – |")
  lines += ["", f"cache build: {build['seconds']:.1f} s, {build['bytes_per_token']:.0f} "
            f"bytes/token; EK-FAC factor fit: {fit['fit_seconds']:.1f} s",
            "EK-FAC tries (qbs, tbs, per-query s, peak RSS MiB): " + ", ".join(
                f"({t['qbs']}, {t['tbs']}, {t['per_query_s']:.3g}, "
                f"{mib(t['peak_rss_bytes']):.0f})" for t in tried)]
  return lines


def _overlap_lines(out_dir, res: dict, num_queries: int) -> list[str]:
  """Top-m agreement between the methods, and cache rank against retention (the rank
  sweep runs its builds and PRISM here)."""
  from prism_jax.attribution.scoring.influence import top_overlap  # pylint: disable=g-import-not-at-top
  rank = {n: _per_query_rankings(out_dir, n, num_queries)
          for n in ("prism", "full_linear", "full", "ekfac")}
  def mean_overlap(a, b, m):
    return float(np.mean([top_overlap(*rank[a][q], *rank[b][q], m) for q in range(num_queries)]))
  lines = ["", "| top-m | cached vs full (linear) | cached vs full (full path) | "
           "cached vs EK-FAC | full (full path) vs EK-FAC | random |", "|---|---|---|---|---|---|"]
  num_docs = len(rank["full"][0][0])
  for m in (10, 100):
    lines.append(f"| {m} | {mean_overlap('prism', 'full_linear', m):.1%} | "
                 f"{mean_overlap('prism', 'full', m):.1%} | {mean_overlap('prism', 'ekfac', m):.1%}"
                 f" | {mean_overlap('full', 'ekfac', m):.1%} | {min(m, num_docs) / num_docs:.1%} |")
  lines += ["", "| cache rank | bytes/token | per-query s | top-10 vs full (linear) | "
            "top-100 vs full (linear) | top-10 vs full (full path) | top-100 vs full (full path) |",
            "|---|---|---|---|---|---|---|"]
  for r in sorted({FLAGS.rank, *map(int, FLAGS.sweep_ranks)}):
    sfx = "" if r == FLAGS.rank else f"_r{r}"
    b = res["build"] if r == FLAGS.rank else _run(out_dir, "build", rank=r, suffix=sfx)
    p = res["prism"] if r == FLAGS.rank else _run(out_dir, "prism", rank=r, suffix=sfx)
    rank[f"prism{sfx}"] = _per_query_rankings(out_dir, f"prism{sfx}", num_queries)
    lines.append(f"| {r} | {b['bytes_per_token']:.0f} | {p['per_query_s']:.4g} | " + " | ".join(
        f"{mean_overlap(f'prism{sfx}', ref, m):.1%}" for ref in ("full_linear", "full")
        for m in (10, 100)) + " |")
  return lines


def main(argv):
  del argv
  check_flags()
  out_dir = FLAGS.out or os.path.join(FLAGS.workdir, "bench_attribution")
  if FLAGS.method:
    return _worker(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  _ensure_trained()
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.train import load_config  # pylint: disable=g-import-not-at-top
  cfg = load_config(FLAGS.workdir)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  queries = _sample_queries(out_dir, packed)
  res = {m: _run(out_dir, m) for m in ("baseline", "build", "prism", "full_linear", "full",
                                       "ekfac_fit")}
  res["ekfac"], tried = _ekfac_within(out_dir, len(queries), res["prism"])
  full_rows = len(_per_query_rankings(out_dir, "full", len(queries))[0][0])
  lines = [
      f"model: {FLAGS.workdir} (d={cfg.model.d_model}, K={cfg.model.num_prototypes}, "
      f"k={cfg.model.k}); {res['build']['tokens']} training tokens in {full_rows} "
      f"sequences ({FLAGS.unit}s); {len(queries)} queries; cache rank {FLAGS.rank}"]
  lines += _speed_lines(res, tried) + _overlap_lines(out_dir, res, len(queries))
  table = "\n".join(lines)
  print(table)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  launcher.run(main)
