"""Decoding speed: one jitted while_loop vs a Python loop over a jitted step vs uncached.

  python -m benchmarks.bench_generate [--config=tiny --batch=1 --prompt_len=16
      --new_tokens=96 --repeats=5]

Random-init models (speed does not depend on the weights); greedy decoding without EOS so
every variant generates exactly --new_tokens. Compile time (first call) is reported apart
from the steady-state time (median of --repeats further calls), side by side in one run.
"""

import dataclasses
import time

import numpy as np
from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher

flags.DEFINE_string("config", "tiny", "model preset name")
flags.DEFINE_integer("batch", 1, "prompts per call")
flags.DEFINE_integer("prompt_len", 16, "prompt tokens")
flags.DEFINE_integer("new_tokens", 96, "generated tokens per prompt")
flags.DEFINE_integer("repeats", 5, "timed calls after the compiling one")
FLAGS = flags.FLAGS

MODES = {"device loop (cached)": dict(loop="device"),
         "host loop (cached)": dict(loop="host"),
         "uncached reference": dict(loop="device", use_cache=False)}


def time_mode(model, prompt, kwargs) -> tuple[float, float]:
  from prism_jax.generate import generate  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  generate(model, prompt, max_new_tokens=FLAGS.new_tokens, **kwargs)
  first = time.perf_counter() - t0
  times = []
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    generate(model, prompt, max_new_tokens=FLAGS.new_tokens, **kwargs)
    times.append(time.perf_counter() - t0)
  return first, float(np.median(times))


def main(argv):
  del argv
  from prism_jax.config import model_preset  # pylint: disable=g-import-not-at-top
  from prism_jax.model.lm import build_model  # pylint: disable=g-import-not-at-top
  check.at_least(1, batch=FLAGS.batch, prompt_len=FLAGS.prompt_len,
                 new_tokens=FLAGS.new_tokens, repeats=FLAGS.repeats)
  base = model_preset(FLAGS.config)
  if FLAGS.prompt_len + FLAGS.new_tokens > base.max_len:
    raise ValueError(f"--prompt_len={FLAGS.prompt_len} + --new_tokens={FLAGS.new_tokens}: "
                     f"at most the {FLAGS.config} model's context of {base.max_len} tokens")
  prompt = np.random.default_rng(0).integers(0, base.vocab_size,
                                             (FLAGS.batch, FLAGS.prompt_len))
  print("| model | mode | first call (compile) s | steady s | tokens/s | vs device loop |")
  print("|---|---|---|---|---|---|")
  for kind in ("prism", "dense"):
    model = build_model(dataclasses.replace(base, kind=kind), seed=0)
    ref = None
    for name, kwargs in MODES.items():
      first, steady = time_mode(model, prompt, kwargs)
      ref = steady if ref is None else ref
      rate = FLAGS.batch * FLAGS.new_tokens / steady
      print(f"| {kind} | {name} | {first:.2f} | {steady:.4f} | {rate:,.0f} | "
            f"{steady / ref:.2f}x time |", flush=True)


if __name__ == "__main__":
  launcher.run(main)
