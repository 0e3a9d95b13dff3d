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
# The three kernel files and the engine check run side by side: one after another they
# took 450-530 s of a session's 1,800 s of device time (the kernels mostly compiling, on
# the CPU), and the lent machine has 16 cores and 80 GB or more of GPU memory. One log each;
# kernels.log gathers the three in order, and the sums.
files=(test_cuda_kernel test_kv8_kernels test_kv_write_kernel)
pids=()
for f in "${files[@]}"; do
  python3 -m pytest -m cuda "tests/$f.py" -q -p no:cacheprovider -rfE > "$OUT/kernels_$f.log" 2>&1 &
  pids+=($!)
done
python3 scripts/gpu/check_engine.py --json "$OUT/check.json" 2>&1 | tee "$OUT/check.log" | grep -v "^  [a-z].*prompts in"
engine_rc=$?
kernels_rc=0
for pid in "${pids[@]}"; do wait "$pid" || kernels_rc=1; done
: > "$OUT/kernels.log"
passed=0; failed=0; errors=0
for f in "${files[@]}"; do
  cat "$OUT/kernels_$f.log" >> "$OUT/kernels.log"
  summary=$(grep -E "(passed|failed|error)" "$OUT/kernels_$f.log" | tail -1)
  echo "  $f: $summary"
  p=$(grep -oE "[0-9]+ passed" <<< "$summary" | cut -d' ' -f1); passed=$(( passed + ${p:-0} ))
  x=$(grep -oE "[0-9]+ failed" <<< "$summary" | cut -d' ' -f1); failed=$(( failed + ${x:-0} ))
  e=$(grep -oE "[0-9]+ errors?" <<< "$summary" | cut -d' ' -f1); errors=$(( errors + ${e:-0} ))
  [ -n "$p" ] || kernels_rc=1  # a file that passed nothing (did not run, or crashed)
done
kernels="$passed passed, $failed failed, $errors errors in $(( $(date +%s) - t0 )) s (3 files and the engine side by side)"
echo "kernel tests: $kernels"
engine=$(tail -1 "$OUT/check.log")
verdict=PASS
[ $kernels_rc -eq 0 ] && [ $engine_rc -eq 0 ] || verdict=FAIL
# the commit as typed here (GPU_COMMIT; the device's git metadata is stale), and the source
# fingerprint scripts/gpu/source_id.sh prints for the code that ran (compare it here)
echo "gpu-check $verdict | kernels: $kernels | engine: ${engine#gpu-check: } | commit ${GPU_COMMIT:-not given} | source $(bash scripts/gpu/source_id.sh) | $(( $(date +%s) - t0 )) s"
[ $verdict = PASS ]
