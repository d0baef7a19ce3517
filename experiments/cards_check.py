"""Times the prototype cards of a trained run from its attribution cache and checks their
top contexts against a brute-force ranking over every training token.

  python -m experiments.cards_check --workdir=runs/demo [--top_m=16] \
      [--results_json=docs/results/cards.json]

The brute force is a plain batched forward of the model over every training row (no cache
code): each valid token's k (prototype, activation) pairs, ranked per prototype by
decreasing activation, ties in row-major token order. A card matches when its contexts'
(row, position) equal the brute force's top-m, up to the order inside near-ties
(|Δa| < 1e-5 a). Prints a table; --results_json writes it for experiments/reproduce.py.
"""

import os
import time

from absl import flags, logging

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
from prism_jax.cli import provenance

flags.DEFINE_string("workdir", "runs/demo", "trained PRISM run")
flags.DEFINE_string("cache_dir", None, "default: <workdir>/attribution_cache")
flags.DEFINE_integer("top_m", 16, "contexts per card")
flags.DEFINE_integer("batch_rows", 32, "rows per brute-force forward")
flags.DEFINE_string("results_json", None, "write the result to this JSON file (e.g. "
                    "docs/results/cards.json)")
FLAGS = flags.FLAGS


def brute_force_top(model, packed, top_m, batch_rows):
  """{proto: [(activation, row, position)] top-m} from a plain forward over all rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, inputs, mask):
    out = nnx.merge(graphdef, state)(inputs, mask_BxT=mask)
    return out.protos.idx_Nxk, out.protos.act_Nxk

  rows = packed.rows("train")
  n_rows = packed.num_rows("train")
  protos, acts, rr, cc = [], [], [], []
  for lo in range(0, n_rows, batch_rows):
    tok = np.asarray(rows["tokens"][lo:lo + batch_rows])
    valid = np.asarray(rows["offset"][lo:lo + batch_rows, 1:]) > 0
    pad = batch_rows - len(tok)  # one compiled shape
    tok_p = np.pad(tok, ((0, pad), (0, 0)))
    valid_p = np.pad(valid, ((0, pad), (0, 0)))
    idx, act = fwd(state, jnp.asarray(tok_p[:, :-1]), jnp.asarray(valid_p))
    k = idx.shape[-1]
    idx = np.asarray(idx).reshape(batch_rows, -1, k)[:len(tok)]
    act = np.asarray(act, np.float64).reshape(batch_rows, -1, k)[:len(tok)]
    r, c = np.nonzero(valid)
    protos.append(idx[r, c].ravel())
    acts.append(act[r, c].ravel())
    rr.append(np.repeat(r + lo, k))
    cc.append(np.repeat(c, k))
  p, a, r, c = (np.concatenate(x) for x in (protos, acts, rr, cc))
  keep = a > 0
  p, a, r, c = p[keep], a[keep], r[keep], c[keep]
  order = np.lexsort((c, r, -a, p))
  out = {}
  for j in order:
    lst = out.setdefault(int(p[j]), [])
    if len(lst) < top_m:
      lst.append((float(a[j]), int(r[j]), int(c[j])))
  return out, int(np.count_nonzero(np.asarray(packed.rows("train")["offset"][:n_rows, 1:]) > 0))


def matches(card, ref) -> tuple[bool, float]:
  """(contexts equal the reference up to the order of near-ties at the cut, max |Δa|)."""
  got = [(c.activation, c.row, c.position) for c in card.contexts]
  if len(got) != len(ref):
    return False, float("inf")
  if not ref:
    return True, 0.0
  dmax = max(abs(g[0] - r[0]) for g, r in zip(got, ref))
  acts_equal = all(abs(g[0] - r[0]) <= 1e-5 * r[0] for g, r in zip(got, ref))
  cut = ref[-1][0]
  sure = lambda lst: {x[1:] for x in lst if abs(x[0] - cut) >= 1e-5 * cut}
  return acts_equal and sure(got) == sure(ref), dmax


def check_flags() -> None:
  """Every flag combination, before the model loads (one `error:` line)."""
  check.at_least(1, top_m=FLAGS.top_m, batch_rows=FLAGS.batch_rows)
  check.existing("workdir", FLAGS.workdir, "run directory")
  check.output_file("results_json", FLAGS.results_json)


def main(argv):
  del argv
  check_flags()
  from prism_jax.analysis import cards as cards_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.attribution.caching import cache as cache_lib  # pylint: disable=g-import-not-at-top
  from prism_jax.data import prepare_data  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs(40)
  logging.set_verbosity(logging.INFO)
  model, cfg, tok = load_for_inference(FLAGS.workdir, needs_prototypes="a card")
  packed = prepare_data(cfg.data, cfg.model.vocab_size, FLAGS.workdir)
  cache = cache_lib.build_cache(
      model, cfg, packed, FLAGS.cache_dir or os.path.join(FLAGS.workdir, "attribution_cache"))
  t0, c0 = time.time(), time.process_time()
  cards = cards_lib.build_cards(model, cfg, packed, cache=cache, top_m=FLAGS.top_m,
                                decode=tok.decode, progress=False)
  wall, cpu = time.time() - t0, time.process_time() - c0
  logging.info("brute-force forward over every training token ...")
  t1 = time.time()
  ref, num_tokens = brute_force_top(model, packed, FLAGS.top_m, FLAGS.batch_rows)
  brute_s = time.time() - t1
  results = [matches(cards.card(i), ref.get(i, [])) for i in range(len(cards))]
  ok = sum(m for m, _ in results)
  dmax = max(d for _, d in results)
  row = {"workdir": FLAGS.workdir, "K": len(cards), "k": cfg.model.k,
         "train_tokens": num_tokens, "top_m": FLAGS.top_m, "cards_wall_s": round(wall, 2),
         "cards_cpu_s": round(cpu, 2), "budget_s": 60, "brute_force_s": round(brute_s, 1),
         "cards_equal_brute_force": ok, "max_abs_activation_diff": dmax,
         **provenance.record("experiments.cards_check")}
  print("\n| K | train tokens | top_m | cards from cache (wall / CPU s) | budget | cards equal "
        "to brute force | max abs Δa |\n|---|---|---|---|---|---|---|")
  print(f"| {row['K']} | {num_tokens:,} | {FLAGS.top_m} | {wall:.1f} / {cpu:.1f} | 60 s | "
        f"{ok}/{len(cards)} | {dmax:.2e} |")
  if FLAGS.results_json:
    provenance.write_results(FLAGS.results_json, row)
    print(f"wrote {FLAGS.results_json}")
  if ok != len(cards):
    raise SystemExit(f"{len(cards) - ok} cards differ from the brute force")


if __name__ == "__main__":
  launcher.run(main)
