#!/usr/bin/env bash
# One H200 call (issue 19): the decode kernels' tests compiled on the GPU, then whole decode
# steps with the split merge inside the attention kernel (fast, the default) and in XLA
# (fast@xm1), 350m and 1b at batch 1 and 1b at batch 64; 350m batch 1 again at the end.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/merge}"; mkdir -p "$OUT"
{
  date; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv || true
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_decode_kernels.py 2>&1 | tail -25
} > "$OUT/decode_kernels_tests_h200.log" 2>&1
timeout 300 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 \
    --variants fast fast@xm1 --extra 1b:64:fast 350m:8:fast 350m:8:fast@xm1 350m:1:fast \
    350m:1:fast@xm1 --reps 5 --budget-s 260 --out "$OUT" 2>&1 | tail -14 | tee "$OUT/decode_floor_log.txt"
tail -3 "$OUT/decode_kernels_tests_h200.log"
