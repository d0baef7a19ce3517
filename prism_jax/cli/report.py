"""Write the interactive HTML report of a prompt's generation by a trained PRISM run.

  prism report --workdir=runs/demo --prompt="The for statement" \
      [--out=<workdir>/report] [--max_new_tokens=32] [--no_attribution] \
      [--screenshot=docs/report_screenshot.png]

Builds (or reuses) the attribution cache (<workdir>/attribution_cache; resumable) and the
prototype cards (<workdir>/cards, from the cache's index), generates greedily, and writes
<out>/index.html: one file, no network requests, open it from disk. Prints the path and the
seconds the cards took. --no_attribution skips the cache (cards then come from a
records-only pass, and the page lists no attributed training sequences).
"""

import os
import time

from absl import flags, logging

from prism_jax.cli import launcher
from prism_jax.cli import sampling_flags

# The rest of the library (orbax, tensorstore, scipy) is imported inside main(): a bad flag or
# --help is answered before it loads (~0.5 s).

flags.DEFINE_string("workdir", None, "trained PRISM run directory (prism train)")
flags.DEFINE_string("prompt", None, "prompt text")
flags.DEFINE_string("out", None, "report directory written (default: <workdir>/report)")
flags.DEFINE_string("cards_dir", None, "the run's cards, reused or built there (prism cards; default: <workdir>/cards)")
flags.DEFINE_string("cache_dir", None, "default: <workdir>/attribution_cache")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate")
flags.DEFINE_integer("top_m", 16, "training contexts per card")
flags.DEFINE_bool("attribution", True, "build/use the attribution cache (attributed "
                  "training sequences per generated token)")
flags.DEFINE_integer("detail_cards", 1024, "cards embedded in full (the sample's prototypes, "
                     "their neighbours, the most used); the rest keep label and usage")
flags.DEFINE_bool("rebuild_cards", False, "rebuild the cards even if a set is saved")
flags.DEFINE_string("screenshot", None, "also write a PNG of the page (headless Chromium)")
flags.mark_flags_as_required(["workdir", "prompt"])
FLAGS = flags.FLAGS
sampling_flags.define()


@launcher.writes_into_run  # one writer per run (its cache, cards, report, sets)
def main(argv):
  del argv
  from prism_jax import io_guard, paths  # pylint: disable=g-import-not-at-top
  from prism_jax.analysis import cards as cards_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.analysis import report  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs(40)
  logging.set_verbosity(logging.INFO)
  sampling = sampling_flags.kwargs()  # a bad value: one line before any work
  model, cfg, tokenizer = load_for_inference(FLAGS.workdir, needs_prototypes="a report")
  prompt = tokenizer.encode(FLAGS.prompt)
  # Claimed before any work: a directory that is not a report's fails here, in seconds.
  out_dir = io_guard.claim_output_dir(FLAGS.out or paths.join(FLAGS.workdir, "report"),
                                      report.REPORT_KIND)
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  cache = None
  if FLAGS.attribution:
    cache_dir = FLAGS.cache_dir or paths.join(FLAGS.workdir, "attribution_cache")
    t0 = time.time()
    cache = cache_lib.open_or_build(model, cfg, packed, cache_dir)
    logging.info("attribution cache ready in %.1fs: %s", time.time() - t0, cache_dir)
  cards_dir = FLAGS.cards_dir or paths.join(FLAGS.workdir, "cards")
  t0 = time.time()
  saved = paths.path(paths.join(cards_dir, cards_lib.CARDS_FILE)).is_file()  # local or gs://
  if saved and not FLAGS.rebuild_cards:
    cards = cards_lib.CardSet.load(cards_dir, model=model)
    print(f"cards: reused {cards_dir} ({time.time() - t0:.1f} s to load)")
  else:
    cards = cards_lib.build_cards(model, cfg, packed, cache=cache, top_m=FLAGS.top_m,
                                  decode=tokenizer.decode, out_dir=cards_dir)
    print(f"cards: {len(cards)} prototypes built from the {cards.identity['source']} in "
          f"{time.time() - t0:.1f} s -> {cards_dir}")
  data = report.report_data(model, cfg, tokenizer.decode, prompt, cards, cache=cache,
                            packed=packed, max_new_tokens=FLAGS.max_new_tokens,
                            metrics_path=paths.join(FLAGS.workdir, "metrics.jsonl"),
                            eos_id=tokenizer.eos_id, detail_cards=FLAGS.detail_cards,
                            **sampling,
                            title="PRISM report: "
                            + os.path.basename(os.path.abspath(FLAGS.workdir)))
  path = report.write_report(out_dir, data)
  if FLAGS.screenshot:
    from prism_jax.analysis import browser  # pylint: disable=g-import-not-at-top
    with browser.open_page(path) as view:
      view.page.screenshot(path=FLAGS.screenshot, full_page=True)
      if view.errors or view.requests:
        raise RuntimeError(f"the page had errors {view.errors} / requests {view.requests}")
    print(f"screenshot: {FLAGS.screenshot}")
  if "://" in str(path):  # gs://: copy it down first (gsutil cp -r), then open the copy
    print(f"report: {path}\nto view it, copy the directory to this machine and open its "
          "index.html")
  else:
    print(f"report: {path}\nopen it in a browser: file://{path}")


if __name__ == "__main__":
  launcher.run(main)
