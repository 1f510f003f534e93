#!/usr/bin/env bash
# One H200 call (issue 19 probe): the persistent decode-chain kernel's tests compiled, then
# the chain timed against XLA (experiments/bench_persistent_decode.py).
#   OUT=$OUT bash experiments/gpu_call_persistent_decode.sh     (from the repository root)
mkdir -p "$OUT"
JAX_PLATFORMS=cuda PYTHONPATH=. timeout 200 python3 -m pytest -q -p no:cacheprovider -rA \
    tests/test_persistent_decode.py > "$OUT/persistent_decode_tests_h200.log" 2>&1
tail -5 "$OUT/persistent_decode_tests_h200.log"
PYTHONPATH=. timeout 280 python3 experiments/bench_persistent_decode.py --out "$OUT" > "$OUT/persistent_decode.log" 2>&1
tail -30 "$OUT/persistent_decode.log"
