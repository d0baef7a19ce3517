"""Checks a written report in headless Chromium against the run's model (the browser
tests' checks, on any report, e.g. the demo's).

  python -m benchmarks.report_check --workdir=runs/demo [--report=<workdir>/report/index.html]

Clicks every token and compares the slices read from the DOM with their sum, the displayed
logit and `decompose` of a fresh forward of the page's token sequence; counts the map's
points; records console errors and non-file requests. Prints one table row.
"""

import json
import os
import re

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("workdir", "runs/demo", "the run the report was written for")
flags.DEFINE_string("report", None, "default: <workdir>/report/index.html")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  check.existing("workdir", FLAGS.workdir, "run directory")
  # the page is read after the model loads: checked first
  check.existing("report", FLAGS.report or os.path.join(FLAGS.workdir, "report", "index.html"),
                 "report (write one with `prism report`, or give --report)")
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prism_jax.analysis import browser  # pylint: disable=g-import-not-at-top
  from prism_jax.model.lm import decompose  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  model, _, _ = load_for_inference(FLAGS.workdir)
  path = FLAGS.report or os.path.join(FLAGS.workdir, "report", "index.html")
  with open(path, encoding="utf-8") as f:
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', f.read(),
                      re.S)
  if not found:
    raise ValueError(f"{path} is not a prism_jax report (no embedded data)")
  data = json.loads(found.group(1).replace("<\\/", "</"))
  seq = np.asarray([data["first_id"]] + [t["id"] for t in data["tokens"]], np.int32)
  out = model(jnp.asarray(seq[None, :-1]))
  parts = decompose(model, out.protos, jnp.asarray(seq[1:]))
  idx, contrib, resid, logit = (np.asarray(x, np.float64) for x in parts)
  worst_sum = worst_ref = 0.0
  with browser.open_page(path) as view:
    toks = view.page.locator("span.tok")
    for j in range(toks.count()):
      toks.nth(j).click()
      shown = float(view.page.locator("#logit").get_attribute("data-value"))
      slices = dict(view.page.eval_on_selector_all(
          "#bar rect.slice", "els => els.map(e => [e.dataset.proto, +e.dataset.value])"))
      worst_sum = max(worst_sum, abs(sum(slices.values()) - shown))
      worst_ref = max([worst_ref, abs(shown - logit[j]), abs(slices["residual"] - resid[j])]
                      + [abs(slices[str(int(i))] - c) for i, c in zip(idx[j], contrib[j])])
    points = view.page.locator("#map circle.pt").count()
    n_tok = toks.count()
  print("| tokens | map points / K | max abs(sum of slices - logit) | max abs(DOM - decompose) "
        "| console errors | requests |\n|---|---|---|---|---|---|")
  print(f"| {n_tok} | {points} / {model.cfg.num_prototypes} | {worst_sum:.2e} | "
        f"{worst_ref:.2e} | {len(view.errors)} | {len(view.requests)} |")
  if worst_ref > 1e-4 or view.errors or view.requests or points != model.cfg.num_prototypes:
    raise SystemExit(f"report check failed: errors {view.errors}, requests {view.requests}")


if __name__ == "__main__":
  launcher.run(main)
