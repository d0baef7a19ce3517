"""Generate from a trained PRISM run and trace every generated token to training text.

  prism attribute --workdir=DIR --prompt="The with statement" \
      [--max_new_tokens=16] [--top=3] [--rank=64] [--cache_dir=DIR/attribution_cache]
  # the cache alone, by every host of a job at once (README "multi-host"):
  prism attribute --workdir=gs://b/run --build_only --distributed=on \
      [--coordinator_address=h0:1234 --num_processes=N --process_id=I] [--stat_shards=64]

The first call builds the attribution cache (resumable: rerun after an interruption); later
calls reuse it, and refuse it if the checkpoint or config changed. Under jax.distributed
(prism_jax/distributed.py's flags, as prism train) every process runs the same
command, loads the checkpoint onto its own devices and writes its share of the cache
(attribution/caching/cache_shards.py); only process 0 prints.
"""

import jax
from absl import flags

from prism_jax.cli import launcher
from prism_jax.cli import sampling_flags

# The rest of the library (orbax, tensorstore, scipy) is imported inside main(): a bad flag or
# --help is answered before it loads (~0.6 s).

flags.DEFINE_string("workdir", None, "trained run directory (prism train)")
flags.DEFINE_string("prompt", None, "prompt text")
flags.DEFINE_integer("max_new_tokens", 16, "tokens to generate")
flags.DEFINE_integer("top", 3, "training snippets per generated token")
flags.DEFINE_integer("rank", None, "eigenvectors of G kept in the cache (default: d_model)")
flags.DEFINE_string("cache_dir", None, "default: <workdir>/attribution_cache")
flags.DEFINE_enum("coupling", "block_diagonal", ["block_diagonal", "co_usage"],
                  "preconditioner of the prototype blocks")
flags.DEFINE_bool("rebuild", False, "rebuild the cache even if one exists (a cache of another "
                  "checkpoint/config is refused otherwise)")
flags.DEFINE_bool("build_only", False, "build (or resume) the cache, print its size, stop "
                  "(no --prompt needed)")
flags.DEFINE_bool("cache_in_memory", True, "read the whole cache into memory (fastest); "
                  "--nocache_in_memory reads only the chunks each query touches (a cache "
                  "larger than this host's memory, e.g. in a bucket)")
flags.DEFINE_integer("stat_shards", None, "cache.stat_shards (>= the process count; default "
                     "64): pass-1 shards folded in order, so any process count <= it gives "
                     "the same bits")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS
sampling_flags.define()

from prism_jax import distributed  # noqa: E402  (registers the multi-host flags)

distributed.define_flags()


def main(argv):
  del argv
  if not FLAGS.build_only and not FLAGS.prompt:
    raise ValueError("--prompt is required (or --build_only to only build the cache)")
  distributed.initialize_from_flags()  # no-op for a single process
  from prism_jax import paths, run_lock  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache_build  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.scoring import influence  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top

  # Every process holds the whole model on its own devices (the build splits the data),
  # one process too: the same per-process program, so P processes build the same bits.
  from prism_jax import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(devices=jax.local_devices())
  model, cfg, tokenizer = load_for_inference(FLAGS.workdir, mesh=mesh,
                                             needs_prototypes="attribution")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  cache_dir = FLAGS.cache_dir or paths.join(FLAGS.workdir, "attribution_cache")
  cache_cfg = cache_lib.CacheConfig(rank=FLAGS.rank, **(
      {"stat_shards": FLAGS.stat_shards} if FLAGS.stat_shards is not None else {}))
  try:
    with run_lock.hold(FLAGS.workdir):  # one writer per run (process 0 of a multi-host build)
      cache_build.write_cache(model, cfg, packed, cache_dir, cache_cfg,
                              overwrite=FLAGS.rebuild)
  except cache_lib.CacheMismatchError as e:
    raise ValueError(f"{e} (rerun with --rebuild to replace it)") from None
  if not distributed.is_main_process():
    return
  # --build_only reads no record: the cache may be far larger than this host's memory
  cache = cache_lib.AttributionCache(cache_dir, model, cfg,
                                     in_memory=FLAGS.cache_in_memory and not FLAGS.build_only)
  if FLAGS.build_only:
    print(f"cache: {cache.path}: {cache.num_tokens} tokens, "
          f"{cache.nbytes_per_token():.0f} bytes/token, {jax.process_count()} process(es)")
    return
  prompt = tokenizer.encode(FLAGS.prompt)
  if not prompt:
    raise ValueError("the prompt encodes to no tokens; pass a non-empty --prompt")
  icfg = influence.InfluenceConfig(coupling=FLAGS.coupling, top=FLAGS.top)
  from prism_jax.model import trust as trust_lib  # pylint: disable=g-import-not-at-top
  print(f"prompt: {FLAGS.prompt!r} (generated: {sampling_flags.label()})")
  seq = list(prompt)
  for tok, att in influence.attribute_generation(
      model, cache, prompt, max_new_tokens=FLAGS.max_new_tokens, cfg=icfg, packed=packed,
      eos_id=tokenizer.eos_id, **sampling_flags.kwargs()):
    seq.append(tok)
    print(f"\n>> {tokenizer.decode([tok])!r}  (prototypes {att.query_protos.tolist()})")
    tr = trust_lib.prediction_trust(model, seq, [len(seq) - 1])
    if not tr.agrees_N[0]:  # the prototypes below do not explain this prediction
      print(f"   note: {trust_lib.RESIDUAL_DECIDED}")
    for rank, (e, s, snip) in enumerate(zip(att.example_ids, att.scores, att.snippets)):
      protos = ", ".join(f"{i}:{v:+.3g}" for i, v in list(att.breakdown[rank].items())[:3])
      print(f"   {rank + 1}. score {s:+.4g}  [{protos}]  {snip!r}")


if __name__ == "__main__":
  launcher.run(main)
