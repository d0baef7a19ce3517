"""Benchmark the fused top-k prototype kernels against the XLA reference.

  python -m benchmarks.bench_kernels --shapes=small,xl --dtypes=float32,bfloat16

On a GPU/TPU it times the compiled kernel; on CPU it runs the Pallas interpreter at small
shapes (timings then only show the interpreter works, not kernel speed) and says so.
"""

from absl import flags

from prism_jax.cli import flag_checks as check
from prism_jax.cli import launcher
import jax
import numpy as np

from benchmarks import kernel_bench_lib as benchmark
from pallas_kernels.topk_reconstruct import api

_SHAPES = flags.DEFINE_list("shapes", None, f"subset of {list(benchmark.SHAPES)}")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "input dtypes")
_DISTANCES = flags.DEFINE_list("distances", ["sqeuclidean"], "sqeuclidean (every "
                               "statistic) and/or cosine (the model's default)")
_ITERS = flags.DEFINE_integer("iters", 5, "timed repetitions (median reported)")
_CHECK = flags.DEFINE_bool("check", False, "first compare kernel and reference outputs")
_BLOCKS = flags.DEFINE_list("blocks", None, "kernel block_n,block_k[,block_d] override")
_PRECISION = flags.DEFINE_string("precision", "tf32x3", "GPU fp32 dot: tf32x3|ieee|tf32")
_AOT = flags.DEFINE_string("aot_topology", None, "e.g. v5e:2x2: instead of timing, compile "
                           "for one chip of this TPU topology (libtpu) and print temp memory")
_WARPS = flags.DEFINE_list("gpu_warps_stages", None, "GPU num_warps,num_stages override")
_MERGE = flags.DEFINE_bool("merge_stats", False, "instead of timing, count the top-k merge "
                           "loop's iterations per tile (NumPy; 256 tokens per shape)")


def print_merge_stats(shapes, blocks):
  """Merge-loop work per tile on random normal inputs (no device needed)."""
  print("| shape | block_n x block_k | k | merge iterations / tile | insertions / row / tile |")
  print("|---|---|---|---|---|")
  for shape in shapes:
    _, d, num_protos, k = benchmark.SHAPES[shape]
    rng = np.random.default_rng(0)
    z, p = rng.standard_normal((256, d)), rng.standard_normal((num_protos, d))
    for bn, bk in blocks:
      its, ins = benchmark.merge_iterations(z, p, k, bn, bk)
      print(f"| {shape} | {bn} x {bk} | {k} | {its:.2f} | {ins:.3f} |", flush=True)


def check_flags() -> None:
  """Every flag combination, before any compile (one `error:` line): the timing loop
  prints a failed shape and goes on, so a bad name would otherwise show as a FAILED row."""
  if _MERGE.value and _AOT.value:
    raise ValueError("--merge_stats and --aot_topology each replace the timing: give one")
  check.known("shapes", _SHAPES.value or [], benchmark.SHAPES)
  check.known("dtypes", _DTYPES.value, ("float32", "bfloat16"))
  check.known("distances", _DISTANCES.value, ("sqeuclidean", "cosine"))
  check.not_empty(dtypes=_DTYPES.value, distances=_DISTANCES.value)
  check.known("precision", [_PRECISION.value], ("tf32x3", "ieee", "tf32"))
  check.at_least(1, iters=_ITERS.value)
  if _BLOCKS.value is not None:
    blocks = check.numbers("blocks", _BLOCKS.value, int, low=1)
    if not 2 <= len(blocks) <= (2 if _MERGE.value else 3):
      raise ValueError(f"--blocks={','.join(_BLOCKS.value)}: give block_n,block_k"
                       + ("" if _MERGE.value else "[,block_d]"))
  if _WARPS.value is not None and len(check.numbers("gpu_warps_stages", _WARPS.value, int,
                                                    low=1)) != 2:
    raise ValueError(f"--gpu_warps_stages={','.join(_WARPS.value)}: give num_warps,num_stages")
  if _AOT.value:
    from prism_jax.config import slice_name  # pylint: disable=g-import-not-at-top
    slice_name(_AOT.value)  # the topology's spelling, before libtpu loads


def main(argv):
  del argv
  check_flags()
  if _MERGE.value:
    blocks = ([tuple(int(v) for v in _BLOCKS.value[:2])] if _BLOCKS.value
              else [(64, 64), (64, 128), (128, 128), (32, 128)])
    print_merge_stats(_SHAPES.value or ["small", "xl"], blocks)
    return
  if _AOT.value:
    print(f"| shape | dtype | implementation | pass | compiled temp GiB ({_AOT.value}, 1 chip) |")
    print("|---|---|---|---|---|")
    for shape in _SHAPES.value or ["xl"]:
      for dtype in _DTYPES.value:
        for (impl, pass_), gib in benchmark.aot_memory(_AOT.value, shape, dtype).items():
          print(f"| {shape} | {dtype} | {impl} | {pass_} | {gib} |", flush=True)
    return
  impl = api.resolve_implementation(None, jax.default_backend())  # what runs here
  kind, peaks = benchmark.device_peaks()
  shapes = _SHAPES.value
  if impl in ("xla", "xla_sparse"):  # no Pallas backend
    impl = "pallas_interpret"
    shapes = shapes or ["micro"]
    print(f"backend {jax.default_backend()} ({kind}): no Pallas backend, running the "
          "kernel in the Pallas INTERPRETER at small shapes; timings are not kernel speed")
  shapes = shapes or ["tiny", "small", "medium", "large", "xl"]
  kw = {"precision": _PRECISION.value} if impl == "pallas_gpu" else {}
  if _WARPS.value and impl == "pallas_gpu":
    kw.update(num_warps=int(_WARPS.value[0]), num_stages=int(_WARPS.value[-1]))
  if _BLOCKS.value:
    names = ("block_n", "block_k", "block_d")
    kw.update({k: int(v) for k, v in zip(names, _BLOCKS.value)})
  print(f"device {kind}; implementation {impl} {kw}; peaks {peaks}", flush=True)
  if _CHECK.value:
    for line in benchmark.check_correctness(impl, kernel_kwargs=kw):
      print("check:", line, flush=True)
  rows = []
  for shape in shapes:
    for dtype in _DTYPES.value:
      for distance in _DISTANCES.value:
        try:  # print each shape as it lands: a device run may be cut short
          new = benchmark.bench_shape(shape, dtype, impl, iters=_ITERS.value,
                                      kernel_kwargs=kw, distance=distance)
          print(benchmark.format_table(new), flush=True)
          rows += new
        except Exception as e:  # pylint: disable=broad-except
          print(f"{shape} {dtype} {distance}: FAILED {type(e).__name__}: {str(e)[:400]}",
                flush=True)
  print("\nall shapes:\n" + benchmark.format_table(rows), flush=True)


if __name__ == "__main__":
  launcher.run(main)
