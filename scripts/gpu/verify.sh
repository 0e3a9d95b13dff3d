#!/usr/bin/env bash
# On the lent GPU machine, from the carried tree's root: install (once), then the CUDA kernel
# tests (-m cuda) and the attention-alone bench; logs under $OUT.
source scripts/gpu/setup.sh "${1:-.whl/b}"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available(), mx.default_device())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used --format=csv
export PYTHONUNBUFFERED=1
python3 -m pytest -m cuda tests/test_cuda_kernel.py -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/verify.log" | tail -40
python3 -m bench.gpu_bench --parts attention --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
# Hardware counters of the decode kernel (Firecracker machines: ncu works; clocks left alone).
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ -z "${SKIP_NCU:-}" ]; then
  timeout 180 "$NCU" --clock-control none --kernel-name regex:paged_attention -c 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    env PYTHONPATH="$PWD:$PYTHONPATH" python3 scripts/gpu/profile_attention.py > "$OUT/ncu.txt" 2>&1
  grep -E "custom_kernel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Block Size|Grid Size" "$OUT/ncu.txt" | head -60
fi
