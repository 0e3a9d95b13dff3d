#!/usr/bin/env bash
# On the lent GPU machine, from the carried tree's root: install (once), then the CUDA kernel
# tests (-m cuda) and the attention-alone bench; logs under $OUT.
source scripts/gpu/setup.sh "${1:-../.whl/b}"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available(), mx.default_device())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used --format=csv
export PYTHONUNBUFFERED=1
python3 -m pytest -m cuda tests/test_cuda_kernel.py -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/verify.log" | tail -40
python3 -m bench.gpu_bench --parts attention --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
