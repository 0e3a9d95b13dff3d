#!/usr/bin/env bash
# The GPU check (docs/GPU.md): run on the lent H200 on the final code of every change to
# engine/, shaders/ or the model adapter, and quote its last line in the closing note.
#   1. install MLX's CUDA backend from the carried wheels (once per lease),
#   2. the CUDA kernel tests (pytest -m cuda),
#   3. the engine end to end through its public API (scripts/gpu/check_engine.py).
# Logs under $OUT; the last line is the summary. About 5-8 minutes, install included.
set -o pipefail
source scripts/gpu/setup.sh "${1:-.whl/b}" || { echo "gpu-check: FAIL install"; exit 1; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available(), mx.default_device())"
t0=$(date +%s)
python3 -m pytest -m cuda tests/test_cuda_kernel.py tests/test_kv8_kernels.py tests/test_kv_write_kernel.py -q -p no:cacheprovider -rfE > "$OUT/kernels.log" 2>&1
kernels_rc=$?
kernels=$(grep -E "^[0-9]+ (passed|failed)|passed|failed" "$OUT/kernels.log" | tail -1)
echo "kernel tests: $kernels"
python3 scripts/gpu/check_engine.py --json "$OUT/check.json" 2>&1 | tee "$OUT/check.log" | grep -v "^  [a-z].*prompts in"
engine_rc=$?
engine=$(tail -1 "$OUT/check.log")
verdict=PASS
[ $kernels_rc -eq 0 ] && [ $engine_rc -eq 0 ] || verdict=FAIL
# the commit as typed here (GPU_COMMIT; the device's git metadata is stale), and the source
# fingerprint scripts/gpu/source_id.sh prints for the code that ran (compare it here)
echo "gpu-check $verdict | kernels: $kernels | engine: ${engine#gpu-check: } | commit ${GPU_COMMIT:-not given} | source $(bash scripts/gpu/source_id.sh) | $(( $(date +%s) - t0 )) s"
[ $verdict = PASS ]
