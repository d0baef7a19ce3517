"""`prism demo` (`make demo`): train the demo PRISM on the embedded corpus, then sample.

Trains into ./runs/demo (resuming if a run is there; a finished run is reused), prints the
validation metrics, then samples a continuation of a prompt (temperature and top-k, seeded:
the same seed gives the same text) and prints, for each generated token, its top prototypes
and their contributions to the token's logit (the contributions of all k active prototypes
plus the residual slice sum to the logit). --greedy traces the greedy continuation instead.

  prism demo [--workdir=runs/demo] [--prompt=...] [--temperature=0.8 --top_k=40 --seed=0]
      [--greedy] [--set train.steps=...]
"""

import textwrap

from absl import flags

from prism_jax.cli import launcher
from prism_jax.cli import sampling_flags

# The rest of the library (orbax, tensorstore) is imported inside main(): a bad flag or --help is
# answered before it loads (~0.3 s).

flags.DEFINE_string("workdir", "runs/demo", "run directory (resumed if present)")
flags.DEFINE_string("prompt", "The for statement", "text to continue")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate")
flags.DEFINE_integer("top", 3, "prototypes shown per token")
flags.DEFINE_multi_string("set", [], "config override KEY=VALUE on the demo preset "
                          "(train.steps=N also moves the bank to N - 20)")
FLAGS = flags.FLAGS
sampling_flags.define()

# What the validation line's abbreviations mean (PRISM.md §3).
LEGEND = (
    "loss / train_loss: cross-entropy on the val split / on as many training tokens "
    "(tokens, train_tokens: how many); r1_bar: mean over prototypes of the best cosine to a "
    "val token (prototypes sit on real data); r2_bar: mean over val tokens of the best "
    "cosine to a prototype (tokens are covered); residual_share: E|r|^2 / E|z|^2 (the part "
    "of z the prototypes leave out); dead_prototypes / dead_frac: never active on the split")
NEXT = """next:
  prism generate --workdir={w} --prompt="The while statement"
  prism attribute --workdir={w} --prompt="The for statement"
  prism report --workdir={w} --prompt="The for statement"
  tensorboard --logdir={w}     # curves of every metric above, per eval"""


def distinct_ratio(ids) -> float:
  """Distinct tokens / tokens: near 1 for varied text, small for one phrase repeated."""
  return len(set(ids)) / max(len(ids), 1)


def _steps_override(sets: list[str]) -> int | None:
  """train.steps among the --set overrides (the demo's bank is placed from it), else None."""
  steps = [s.split("=", 1)[1] for s in sets if s.split("=", 1)[0].strip() == "train.steps"]
  if not steps:
    return None
  if not steps[-1].strip().isdigit():
    raise ValueError(f"--set train.steps={steps[-1]!r}: give a positive integer")
  return int(steps[-1])


def main(argv):
  del argv
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.loading import load_for_inference  # pylint: disable=g-import-not-at-top
  from prism_jax.train import (ConfigMismatchError, apply_overrides,  # pylint: disable=g-import-not-at-top
                               train)
  from prism_jax.train.metrics import quiet_library_logs  # pylint: disable=g-import-not-at-top
  quiet_library_logs(40)  # orbax's read-only notices are noise here
  sampling = sampling_flags.kwargs()  # a bad --temperature / --top_k: one line, no work
  if FLAGS.max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
  cfg = apply_overrides(preset("demo", steps=_steps_override(FLAGS.set)), list(FLAGS.set))
  try:
    result = train(cfg, FLAGS.workdir)
  except ConfigMismatchError as e:
    raise ConfigMismatchError(f"{e} (remove {FLAGS.workdir} to retrain the demo from "
                              "scratch)") from None
  ev = result.eval
  if result.start_step == result.final_step:
    print(f"\nreusing the finished run in {result.workdir} (step {result.final_step})")
  else:
    print(f"\ntrained steps {result.start_step}..{result.final_step} in "
          f"{result.wall_s:.0f} s; workdir {result.workdir}")
  if ev:
    from prism_jax import faithfulness  # pylint: disable=g-import-not-at-top
    shown = {k: v for k, v in ev.items() if k not in faithfulness.KEYS}
    print(textwrap.fill("validation: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()),
                        100, subsequent_indent="  "))
    print(textwrap.fill(f"({LEGEND})", 100, initial_indent="  ", subsequent_indent="   "))
    if "agreement" in ev:
      print(textwrap.fill("faithfulness: " + faithfulness.format_line(ev), 100,
                          subsequent_indent="  "))
      print(textwrap.fill(f"({faithfulness.LEGEND})", 100, initial_indent="  ",
                          subsequent_indent="   "))

  from prism_jax.generate import generate  # pylint: disable=g-import-not-at-top
  from prism_jax.analysis.token_report import signature_line, token_report  # pylint: disable=g-import-not-at-top
  model, cfg, tok = load_for_inference(FLAGS.workdir)
  prompt_ids = tok.encode(FLAGS.prompt)
  max_new = min(FLAGS.max_new_tokens, cfg.model.max_len - len(prompt_ids))
  out = generate(model, [prompt_ids], max_new_tokens=max_new, eos_id=tok.eos_id, **sampling)
  n = int(out.lengths_B[0])
  new_ids = out.tokens_BxL[0, :n].tolist()
  how = sampling_flags.label()
  print(f"\nprompt: {FLAGS.prompt!r}")
  print(f"sample ({how}):\n{textwrap.indent(FLAGS.prompt + tok.decode(new_ids), '  ')}")
  print(f"distinct tokens: {distinct_ratio(new_ids):.2f} ({len(set(new_ids))} of {n})\n")
  print(token_report(out, tok.decode, top=FLAGS.top))
  if out.trace is not None:
    shown = sorted({int(i) for i in out.trace.idx_BxLxk[0, :n, 0]})[:12]
    print("\nprototype signatures (tokens each pushes up most, from W p_i):")
    for pid in shown:
      print(f"  #{pid:<4} {signature_line(model, pid, tok.decode)}")
  print("\n" + NEXT.format(w=FLAGS.workdir))


if __name__ == "__main__":
  launcher.run(main)
