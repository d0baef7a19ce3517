"""The removal table of experiments.lds (printed by it, and in its RESULTS.md section)."""

import numpy as np


def removal_section(deltas: dict, ms: list[int], seed_gap: np.ndarray
                    ) -> tuple[list[str], dict]:
  """The removal table's lines and per method the (mean, lo, hi) per m; removal curves off
  (--removal_queries=0: `deltas` of 0 queries) gives one line saying so and no curves."""
  from prism_jax.attribution.quality import lds  # pylint: disable=g-import-not-at-top
  n_queries = next(iter(deltas.values())).shape[0] if deltas else 0
  if n_queries == 0:
    return ["", "removal curves: off (--removal_queries=0)"], {}
  lines = ["", f"removal: query loss change vs the full model (m = 0), mean [95% bootstrap "
           f"CI] over {n_queries} queries; seed noise |full seed 1 − full seed 0| "
           f"= {seed_gap[:n_queries].mean():.3f} nats (all queries: "
           f"{seed_gap.mean():.3f})", "",
           "| method | " + " | ".join(f"m={m}" for m in ms) + " |",
           "|---|" + "---|" * len(ms)]
  removal_ci = {}
  for name, d in deltas.items():
    removal_ci[name] = [lds.bootstrap_ci(d[:, j]) if n_queries > 1
                        else (float(d[0, j]),) * 3 for j in range(len(ms))]
    lines.append(f"| {name} | " + " | ".join(f"{a:+.3f} [{lo:+.3f}, {hi:+.3f}]" for a, lo, hi
                                            in removal_ci[name]) + " |")
  return lines, removal_ci
