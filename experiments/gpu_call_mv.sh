#!/usr/bin/env bash
# One H200 call for the matvec kernels (issue 19): their tests compiled on the GPU, the
# kernels alone beside XLA (bench_matvec.py), whole decode steps with and without them.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/mv}"; mkdir -p "$OUT"
{
  date; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv || true
  JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_decode_kernels.py 2>&1 | tail -25
} > "$OUT/decode_kernels_tests_h200.log" 2>&1
timeout 170 python3 experiments/bench_matvec.py --budget-s 150 --out "$OUT" 2>&1 | tee "$OUT/bench_matvec_log.txt" | tail -3
timeout 240 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 \
    --variants fast fast@mv0 fast@mvo4_mvi1024 fast@mvo4_mvi4096 fast@mvo8_mvi4096_mvw8 \
    --extra 350m:1:fast@mv0 --budget-s 200 --out "$OUT" 2>&1 | tail -16 | tee "$OUT/decode_floor_log.txt"
