#!/usr/bin/env bash
# One-shot GPU check of the Pallas top-k kernels (issue 5): correctness with
# interpret=False against the XLA reference, then bench_kernels up to the XL shape.
# Written for the lent H200 (jax 0.11.x + CUDA plugin preinstalled, no network):
#   bash experiments/device_check.sh            (from the repo root; ~6 min)
# Logs go to $OUT (or /tmp/kernels_out) as check.log and bench.log.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT_DIR="${OUT:-/tmp/kernels_out}"; mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
"$PY" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv || true
# 1. Correctness on fresh inputs (fp32 with 3xTF32, then exact fp32 FMA), compiled kernel.
timeout 150 "$PY" -m experiments.bench_kernels --check --shapes=tiny --dtypes=float32 \
  --iters=2 2>&1 | tee "$OUT_DIR/check.log"
timeout 60 "$PY" -c "
from pallas_kernels.topk_reconstruct import benchmark
for l in benchmark.check_correctness('pallas_gpu', shapes=((512, 96, 1000, 16),),
                                     kernel_kwargs={'precision': 'ieee'}):
  print('check ieee:', l)" 2>&1 | tee -a "$OUT_DIR/check.log"
# 2. Timings, reference vs kernel, forward and forward+backward, up to XL.
timeout 330 "$PY" -m experiments.bench_kernels --shapes=small,large,xl \
  --dtypes=bfloat16,float32 --iters=3 2>&1 | tee "$OUT_DIR/bench.log"
