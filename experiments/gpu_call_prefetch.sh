#!/usr/bin/env bash
# One H200 call (issue 19): the decode kernels' tests compiled on the GPU, then whole decode
# steps with the norm kernels pulling the next product's weights into L2 (fast@pf<MiB>)
# against none (fast), 350m and 1b at batch 1; 350m batch 1 again at the end.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/prefetch}"; mkdir -p "$OUT"
{
  date; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv || true
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_decode_kernels.py 2>&1 | tail -25
} > "$OUT/decode_kernels_tests_h200.log" 2>&1
timeout 330 python3 experiments/decode_floor.py --presets 350m --batches 1 \
    --variants fast fast@pf1 fast@pf2 fast@pf4 fast@pf8 fast@pf64 \
    --extra 1b:1:fast 1b:1:fast@pf4 1b:1:fast@pf16 1b:1:fast@pf64 350m:1:fast 350m:1:fast@pf4 \
    --reps 5 --budget-s 300 --out "$OUT" 2>&1 | tail -15 | tee "$OUT/decode_floor_log.txt"
tail -3 "$OUT/decode_kernels_tests_h200.log"
