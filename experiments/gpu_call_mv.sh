#!/usr/bin/env bash
# One H200 call: the decode kernels' tests compiled on the GPU, then whole decode steps with
# and without the matvec kernels (fast vs fast@mv0) and a few matvec tilings.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/mv}"; mkdir -p "$OUT"
{
  date; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv || true
  JAX_PLATFORMS=cuda timeout 120 python3 -m pytest -q -rA -p no:cacheprovider tests/test_decode_kernels.py 2>&1 | tail -25
} > "$OUT/decode_kernels_tests_h200.log" 2>&1
timeout 420 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 \
    --variants fast fast@mv0 --extra 350m:1:fast@mvo16 350m:1:fast@mvi256 350m:1:fast@mvw2 \
    350m:1:fast@mvw8 350m:1:fast@mvst2 1b:1:fast@mvo32 1b:1:fast@mvo8 350m:8:fast 350m:8:fast@mv0 \
    1b:64:fast 350m:1:fast --budget-s 380 --out "$OUT" 2>&1 | tail -40 | tee "$OUT/decode_floor_log.txt"
