#!/usr/bin/env bash
# The demo's training time at two bank sizes, in turn (issue 44 item 5's +15% budget):
# `prism train --config=tiny` (600 steps, the demo's training) with model.num_prototypes=A and
# =B, twice each, interleaved, fresh workdirs, the packed data shared. Prints each run's wall
# seconds and steady training seconds (600 x 16 x 128 tokens / steady tok/s).
# Usage: bash benchmarks/tiny_default_time.sh [A=512] [B=2048]   (from the repository root)
set -euo pipefail
A=${1:-512}; B=${2:-2048}
export JAX_PLATFORMS=cpu
D=$(mktemp -d -t tiny_time.XXXXXX); trap 'rm -rf "$D"' EXIT
.venv/bin/prism train --config=tiny --set train.steps=1 --set train.proto_init_step=0 \
  --set data.packed_dir=$D/data --workdir=$D/pack > $D/pack.log 2>&1  # pack once
for i in 1 2; do
  for K in $A $B; do
    W=$D/K${K}_$i
    s=$(date +%s.%N)
    .venv/bin/prism train --config=tiny --set model.num_prototypes=$K \
      --set data.packed_dir=$D/data --workdir=$W > $W.log 2>&1
    e=$(date +%s.%N)
    .venv/bin/python -c "
import json
rs = [json.loads(l) for l in open('$W/metrics.jsonl')]
r = [x for x in rs if x.get('split') == 'train' and 'steady_tokens_per_s' in x][-1]
print('K$K run $i: wall %.1f s, steady training %.1f s' % ($e - $s, 600 * 16 * 128 / r['steady_tokens_per_s']))"
  done
done
