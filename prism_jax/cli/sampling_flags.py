"""The sampling flags every generating command shares, with the library's defaults
(prism_jax.generate.SAMPLING: temperature 0.8, top-k 40, seed 0; --greedy for argmax).

  sampling_flags.define()                # at import, beside the command's own flags
  kwargs = sampling_flags.kwargs()       # temperature / top_k / seed for generate()
  sampling_flags.label()                 # "temperature 0.8, top-k 40, seed 0" or "greedy"
"""

from absl import flags

FLAGS = flags.FLAGS

# prism_jax.generate (and jax) is imported inside the functions: it loads when a command defines
# these flags, not when this module is imported.


def define(temperature: float | None = None,
           seed_help: str = "sampling seed (same seed, same text)") -> None:
  """The flags, at the library's defaults; a protocol with its own (the suppression
  measurements sample at temperature 1) passes its temperature and says what else its
  seed draws."""
  from prism_jax.generate import SAMPLING  # pylint: disable=g-import-not-at-top
  flags.DEFINE_float("temperature", SAMPLING["temperature"] if temperature is None
                     else temperature, "softmax temperature of the sample; 0 = greedy")
  flags.DEFINE_integer("top_k", SAMPLING["top_k"], "sample from the k most likely tokens; "
                       "0 = off")
  flags.DEFINE_integer("seed", SAMPLING["seed"], seed_help)
  flags.DEFINE_bool("greedy", False, "greedy decoding (temperature 0) instead of sampling")


def kwargs() -> dict:
  if FLAGS.temperature < 0 or FLAGS.top_k < 0:
    raise ValueError(f"--temperature and --top_k must be >= 0, got {FLAGS.temperature}, "
                     f"{FLAGS.top_k}")
  return {"temperature": 0.0 if FLAGS.greedy else FLAGS.temperature,
          "top_k": FLAGS.top_k or None, "seed": FLAGS.seed}


def label() -> str:
  from prism_jax.generate import sampling_label  # pylint: disable=g-import-not-at-top
  k = kwargs()
  return sampling_label(k["temperature"], k["top_k"], k["seed"])
