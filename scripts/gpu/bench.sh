#!/usr/bin/env bash
# On the lent GPU machine (MLX installed by verify.sh in the same lease): the engine benches.
source scripts/gpu/setup.sh "${1:-.whl/b}"
export PYTHONUNBUFFERED=1
python3 -m bench.gpu_bench --parts "${PARTS:-attention,throughput,agreement,mixed,paste}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
