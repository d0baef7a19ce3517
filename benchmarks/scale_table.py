"""The scale table: the train step of every recipe preset (the GPT-2 sizes, the Llama-style
1B) compiled ahead of time for TPU pods.

Compiler estimates, not measurements (no TPU runs): benchmarks/scale_lib.py says what each
figure is and where it comes from.

  nice -n 10 python -m benchmarks.scale_table --results_json=docs/results/scale_table.json
  python -m experiments.reproduce      # renders it into docs/RESULTS.md "Scale table"

Every compile result is cached in --cache, so an interrupted run resumes. Needs libtpu
(`pip install -e ".[tpu-aot]"`). A full table (5 presets x 2 kinds x 2 remat x 2 targets)
is 40 searches, each a few 2- and 4-block compiles (--shallow) and one or two at full depth
(xl: ~250 s each on 2 cores): --config/--targets/--remat/--max_compiles cut it. Then the
recipes' accumulated steps are derived from the rows (benchmarks/scale_accum.py) and one
per target is compiled (--accum_check).
"""

from __future__ import annotations

import dataclasses
import os
import time

from benchmarks import scale_lib  # sets the compile-only environment before jax loads
from benchmarks import scale_accum
from results_md.scale_table import scale_table_markdown

from absl import flags  # noqa: E402  pylint: disable=wrong-import-order

from prism_jax.cli import launcher as cli  # noqa: E402
from prism_jax.cli import provenance  # noqa: E402

TARGETS = scale_lib.TARGETS
flags.DEFINE_list("targets", list(scale_lib.DEFAULT_TARGETS), f"of {sorted(TARGETS)}")
flags.DEFINE_list("config", ["small", "medium", "large", "xl", "llama_1b"], "model presets")
flags.DEFINE_list("kinds", ["prism", "dense"], "prism and/or dense")
flags.DEFINE_list("remat", ["off", "on"], "rematerialise blocks: off and/or on")
flags.DEFINE_integer("seq_len", 1024, "sequence length (the GPT-2 presets' context)")
flags.DEFINE_integer("max_batch", 256, "largest per-chip batch tried")
flags.DEFINE_integer("start_batch", 1, "per-chip batch the search starts at (a power of 2)")
flags.DEFINE_list("shallow", ["2", "4"], "search the batch on peaks extrapolated in depth "
                  "from compiles at these two block counts, then compile the full depth "
                  "(empty: search at full depth)")
flags.DEFINE_float("resolution", 0.25, "bisection stops when hi - lo <= max(1, this x lo); "
                   "with --shallow only the first (depth-extrapolated) search, the full-depth "
                   "search is exact")
flags.DEFINE_integer("max_compiles", 0, "stop after this many new compiles (0: no limit; -1: "
                     "none, the table from the cache alone, up to the first search not in it)")
flags.DEFINE_string("cache", "benchmarks/scale_table_cache.json",
                    "every compile's result (tracked: commit it, searches resume from it)")
flags.DEFINE_string("accum_check", "auto", "the preset whose accumulated recipe step is "
                    "compiled on each target (auto: the smallest recipe that accumulates there, "
                    "else the smallest; none: no check)")
flags.DEFINE_string("results_json", None, "write the table's rows here")

FLAGS = flags.FLAGS


def _may_compile(cache: scale_lib.Cache) -> bool:
  return FLAGS.max_compiles >= 0 and not (FLAGS.max_compiles
                                          and cache.new >= FLAGS.max_compiles)


def main(argv: list[str]) -> None:
  del argv
  bad = [t for t in FLAGS.targets if t not in TARGETS]
  if bad:
    raise ValueError(f"unknown --targets {bad}; choose from {sorted(TARGETS)} (slices by "
                     "Google's names: the 8-chip v5p:2x2x2 is v5p-16)")
  if FLAGS.accum_check not in ("auto", "none", *scale_accum.config.RECIPES):
    raise ValueError(f"--accum_check={FLAGS.accum_check}: auto, none or one of "
                     f"{list(scale_accum.config.RECIPES)}")
  if set(FLAGS.remat) - {"off", "on"} or set(FLAGS.kinds) - {"prism", "dense"}:
    raise ValueError("--remat takes off,on and --kinds prism,dense")
  prov = provenance.record("benchmarks.scale_table")
  cache = scale_lib.Cache(FLAGS.cache, scale_lib.code_key())
  start = time.time()
  cpu0 = os.times()
  rows = scale_lib.build(cache, FLAGS.targets, FLAGS.config, FLAGS.kinds,
                         [r == "on" for r in FLAGS.remat], FLAGS.seq_len, FLAGS.start_batch,
                         FLAGS.max_batch, FLAGS.resolution, FLAGS.max_compiles,
                         tuple(int(x) for x in FLAGS.shallow) or None)
  plans = scale_accum.recipe_rows(rows, scale_lib.CHIPS)
  done = {r["target"] for r in rows}
  presets = ({} if FLAGS.accum_check == "none" else
             scale_accum.check_presets(plans, [t for t in FLAGS.targets if t in done])
             if FLAGS.accum_check == "auto" else
             {t: FLAGS.accum_check for t in FLAGS.targets if t in done})
  checks = scale_accum.checks(cache, rows, plans, presets, lambda: _may_compile(cache))
  cpu1 = os.times()
  fresh = [f"{r['target']} {r['preset']} {r['kind']} remat={'on' if r['remat'] else 'off'}"
           + (f" grad_accum={r['grad_accum']} (check)" if "grad_accum" in r else "")
           for r in rows + checks if r.get("compiled_this_run")]
  data = {**prov, "code_key": cache.code,
          "note": "compiler estimates from AOT compiles (libtpu compile-only devices), "
                  "not measurements on a TPU",
          "chips": {k: dataclasses.asdict(v) for k, v in scale_lib.CHIPS.items()},
          "targets": {t: {**dataclasses.asdict(TARGETS[t]), "slice": TARGETS[t].slice}
                      for t in FLAGS.targets},
          "resolution": FLAGS.resolution, "shallow": [int(x) for x in FLAGS.shallow],
          "max_batch": FLAGS.max_batch,
          "new_compiles": cache.new, "fresh_rows": fresh, "wall_s": round(time.time() - start),
          "cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system),
          "rows": rows, "ratios": scale_lib.ratios(rows),
          "recipe_rows_per_step": scale_accum.config.RECIPE_ROWS, "recipes": plans,
          "accum_checks": checks}
  print(scale_table_markdown(data))
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, data)
    print(f"wrote {FLAGS.results_json} ({cache.new} new compiles, {data['cpu_s']} CPU s)")


if __name__ == "__main__":
  cli.run(main)
