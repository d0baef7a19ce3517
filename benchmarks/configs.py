"""The one table of benchmark configs that the scripts of benchmarks/ share.

TRAIN: a train step's config by name, (preset, overrides) on prism_jax.config's presets:
  byte   issue 11's byte-level config: 4 layers / 4 heads / d 128 / ctx 64 / batch 12,
         K 512, k 8 (the tiny preset at byte vocabulary)
  tiny   the tiny preset itself (batch 16 x 128)
  small  GPT-2 124M with K 8192, k 16 at a CPU-sized batch 1 x 256 (the small_smoke preset:
         the short-run schedule these timings were taken with)
  The loss is the preset's (tiny: λ_proto_kl 1; small: no W z_hat term); bench_train adds
  its loss variants, profile_train its PROFILE_LOSS.
LAYER: the prototype layer's op shapes by name, (N tokens, D, K, k): the kernel op's table
  (benchmarks/kernel_bench_lib.SHAPES, micro .. xl) plus `wide` (many tokens,
  a small bank); bench_kernels, bench_gather_dtype and bench_layer_backward time these.
layer_shape(name): the (N, D, K, k) of a TRAIN config's prototype layer (N = batch x
  seq_len): what bench_topk times, so the op benchmarks and the train benchmarks agree.
"""

from __future__ import annotations

# name -> (preset, overrides)
TRAIN: dict[str, tuple[str, tuple[str, ...]]] = {
    # K pinned at 512: the config of issue 11's byte runs and the recorded throughput rows
    # (the tiny preset moved to K 2048 in issue 44)
    "byte": ("tiny", ("model.num_prototypes=512", "data.tokenizer=byte", "model.vocab_size=258",
                      "model.max_len=64",
                      "data.seq_len=64", "train.batch_size=12", "train.lr=1e-3",
                      "train.min_lr_ratio=0.1", "train.warmup_steps=100", "train.b2=0.99")),
    "tiny": ("tiny", ()),
    "small": ("small_smoke", ("data.seq_len=256", "train.batch_size=1")),
}
# profile_train's loss on top of TRAIN (its round-2 profile timed λ_proto 1 at small)
PROFILE_LOSS: dict[str, tuple[str, ...]] = {"small": ("loss.lambda_proto=1.0",)}


def _kernel_shapes() -> dict[str, tuple[int, int, int, int]]:
  from benchmarks import kernel_bench_lib as benchmark  # pylint: disable=g-import-not-at-top
  return dict(benchmark.SHAPES)


def layer_shapes() -> dict[str, tuple[int, int, int, int]]:
  """LAYER: name -> (N, D, K, k) (a function: the kernel package imports jax)."""
  return dict(_kernel_shapes(), wide=(16384, 64, 256, 16))


def train_config(name: str, extra: tuple[str, ...] | list[str] = ()):
  """The Config of TRAIN[name] with `extra` overrides after the table's."""
  from prism_jax.config import preset  # pylint: disable=g-import-not-at-top
  from prism_jax.train import apply_overrides  # pylint: disable=g-import-not-at-top
  if name not in TRAIN:
    raise ValueError(f"unknown config {name!r}; choose from {sorted(TRAIN)}")
  base, sets = TRAIN[name]
  return apply_overrides(preset(base), list(sets) + list(extra))


def layer_shape(name: str) -> tuple[int, int, int, int]:
  """(N = batch x seq_len, D, K, k) of TRAIN[name]'s prototype layer."""
  cfg = train_config(name)
  return (cfg.train.batch_size * cfg.data.seq_len, cfg.model.d_model,
          cfg.model.num_prototypes, cfg.model.k)
