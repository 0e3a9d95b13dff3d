#!/usr/bin/env bash
# On the lent GPU machine (issue #24, bench/results/gpu.md session 26): does the gathered
# prefill (MLX's fused attention at padded shapes, built at load) pay in the engine?
#   1. the prefill chunk's attention: paged kernel against the gathered path, per shape;
#   2. one unrecorded bench process (a fresh machine's first one compiles for over 100 s);
#   3. the long paste with chunks of ${FROM:-64} tokens or more gathered, against the kernel,
#      alternated ${RUNS:-2} times (each run: 2 repeats, the engine's load time reported).
# Everything goes under $OUT as it comes, so a run cut by the device budget keeps what ran.
# About 8 minutes on an H100 (under one call's 600 s). Then, if it wins: the default, and
# check.sh on that code.
source scripts/gpu/setup.sh "${1:-.whl/b}" >/dev/null 2>&1 || { echo "setup failed"; exit 1; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gathered-ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 scripts/gpu/prefill_attention.py --shapes 1B,8B --repeats 5 \
    --cases 64:8192,128:8192,256:8192,256:2048 --json "$OUT/prefill_attention.json" \
    > "$OUT/prefill_attention.txt" 2>&1
echo "prefill_attention rc=$?"; grep -E "^(1B|8B) " "$OUT/prefill_attention.txt"
timeout 200 python3 -m bench.gpu_bench --parts paste --repeats 1 > "$OUT/throwaway.log" 2>&1
echo "throwaway rc=$?"
for run in $(seq 1 "${RUNS:-2}"); do
  for arm in "${FROM:-64}" off; do
    t=$(date +%s)
    timeout 150 python3 -m bench.gpu_bench --parts paste --repeats 2 --gathered-prefill "$arm" \
        --json "$OUT/paste_${arm}_$run.json" --out "$OUT/paste_${arm}_$run.md" \
        > "$OUT/paste_${arm}_$run.log" 2>&1
    echo "== gathered ${arm}, run $run: rc=$? $(( $(date +%s) - t )) s"
    grep -E "^\| (streaming gaps|short chat|the paste|the engine's load)" "$OUT/paste_${arm}_$run.md"
  done
done
