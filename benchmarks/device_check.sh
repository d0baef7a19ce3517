#!/usr/bin/env bash
# One-shot GPU check of the Pallas top-k kernels (issue 5), for a lent GPU machine (the
# H200 had jax 0.11.x + the CUDA plugin preinstalled and no network). About 9 minutes:
#   bash benchmarks/device_check.sh            (from the repo root)
# 1. correctness with interpret=False at the shipped defaults (gpu.default_config);
# 2. bench_kernels small + XL, both distances, every timed kernel checked against the
#    timed reference (ids = ref, z_hat rel err columns);
# 3. the backward's bank scatters and bf16 gathers, old vs new, timed on the GPU;
# 4. a short block sweep around the defaults at XL bf16.
# Logs go to $OUT (or /tmp/kernels_out): check.log, bench.log, backward.log, sweep.log.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT_DIR="${OUT:-/tmp/kernels_out}"; mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
"$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv || true
timeout 120 "$PY" -m benchmarks.bench_kernels --check --shapes=tiny --dtypes=bfloat16 \
  --iters=2 2>&1 | tee "$OUT_DIR/check.log"
timeout 200 "$PY" -m benchmarks.bench_kernels --shapes=small,xl --dtypes=bfloat16 \
  --distances=cosine,sqeuclidean --iters=3 2>&1 | tee "$OUT_DIR/bench.log"
timeout 60 "$PY" -m benchmarks.bench_kernels --shapes=xl --dtypes=float32 --iters=3 \
  2>&1 | tee -a "$OUT_DIR/bench.log"
# The backward's bank scatters (one set vs the former two) and the bf16 row gathers, on the
# GPU itself (pure XLA: no kernel runs in these two).
timeout 90 "$PY" -m benchmarks.bench_layer_backward --backend=gpu --shapes=small,large,xl \
  --bytes_only= --layer_shapes= 2>&1 | tee "$OUT_DIR/backward.log"
timeout 60 "$PY" -m benchmarks.bench_gather_dtype 2>&1 | tee -a "$OUT_DIR/backward.log"
for cfg in "128,128,64 8,4" "64,128,32 4,5" "64,256,64 8,3"; do
  set -- $cfg
  echo "blocks=$1 warps_stages=$2"
  timeout 40 "$PY" -m benchmarks.bench_kernels --shapes=xl --dtypes=bfloat16 \
    --distances=cosine --blocks="$1" --gpu_warps_stages="$2" --iters=3 2>&1 | grep "| xl"
done 2>&1 | tee "$OUT_DIR/sweep.log"
