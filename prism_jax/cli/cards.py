"""Build the prototype cards of a trained PRISM run and list the most used ones.

  prism cards --workdir=runs/demo [--out=<workdir>/cards] [--top_m=16] [--show=10] \
      [--noattribution] [--rebuild]

A card is one prototype's top training contexts, the tokens it promotes (W p_i), its usage,
activation histogram and neighbours (prism_jax/analysis/cards.py). The cards come from the
run's attribution cache (<workdir>/attribution_cache, built or reused; --cache_dir) or, with
--noattribution, from a records-only pass. The set is saved to --out, where `prism report`
and `prism suppress --select=keywords:...` reuse it; a saved set is reused unless --rebuild.
(experiments/cards_check.py checks cards against a brute-force ranking.)
"""

import time

from absl import flags, logging

from prism_jax.cli import launcher

# The library and jax are imported inside main(): a bad flag or --help is answered before jax loads
# (~1.7 s).

flags.DEFINE_string("workdir", None, "trained PRISM run directory (prism train)")
flags.DEFINE_string("out", None, "cards directory written (default: <workdir>/cards)")
flags.DEFINE_string("cache_dir", None, "default: <workdir>/attribution_cache")
flags.DEFINE_bool("attribution", True, "build/use the attribution cache (else a records-only "
                  "pass over the training split)")
flags.DEFINE_integer("top_m", 16, "training contexts per card")
flags.DEFINE_integer("show", 10, "cards printed (most used first)")
flags.DEFINE_bool("rebuild", False, "rebuild the cards even if a set is saved in --out")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


@launcher.writes_into_run  # one writer per run (its cache, cards, report, sets)
def main(argv):
  del argv
  if FLAGS.top_m < 1 or FLAGS.show < 0:
    raise ValueError(f"--top_m must be >= 1 and --show >= 0, got {FLAGS.top_m}, {FLAGS.show}")
  from prism_jax import paths  # pylint: disable=g-import-not-at-top
  from prism_jax.analysis import cards as cards_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs(40)
  logging.set_verbosity(logging.INFO)
  model, cfg, tokenizer = load_for_inference(FLAGS.workdir, needs_prototypes="cards")
  out = FLAGS.out or paths.join(FLAGS.workdir, "cards")
  t0 = time.time()
  if paths.path(paths.join(out, cards_lib.CARDS_FILE)).is_file() and not FLAGS.rebuild:
    cards = cards_lib.CardSet.load(out, model=model)
    print(f"cards: reused {out} ({time.time() - t0:.1f} s to load; --rebuild to rebuild)")
  else:
    packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
    cache = None
    if FLAGS.attribution:
      cache = cache_lib.open_or_build(model, cfg, packed, FLAGS.cache_dir or paths.join(
          FLAGS.workdir, "attribution_cache"))
    cards = cards_lib.build_cards(model, cfg, packed, cache=cache, top_m=FLAGS.top_m,
                                  decode=tokenizer.decode, out_dir=out)
    print(f"cards: {len(cards)} prototypes built from the {cards.identity['source']} in "
          f"{time.time() - t0:.1f} s -> {out}")
  used = sorted((cards.card(i) for i in range(len(cards))), key=lambda c: -c.usage)
  for c in used[:FLAGS.show]:
    promoted = " ".join(repr(t) for t, _ in c.promoted[:3])
    context = repr(c.contexts[0].text) if c.contexts else "-"
    print(f"  #{c.proto_id:<5} usage {100 * c.usage:5.2f}%  {c.label}\n"
          f"         promotes {promoted}; top context {context}")


if __name__ == "__main__":
  launcher.run(main)
