#!/usr/bin/env bash
# One H200 call: the decode chain megakernel's tests compiled (it against XLA's chain, 1-3
# layers), then, if they pass, the whole presets timed beside XLA and the floor.
#   OUT=$OUT bash experiments/gpu_call_chain.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 200 python3 -m pytest -x -v -p no:cacheprovider \
    tests/test_chain_mgpu.py > "$OUT/chain_tests_h200.log" 2>&1
rc=$?
grep -E "PASS|FAIL|ERROR|passed|failed|Timeout" "$OUT/chain_tests_h200.log" | tail -20
[ $rc -eq 0 ] || { echo "tests rc=$rc"; tail -30 "$OUT/chain_tests_h200.log"; exit $rc; }
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 experiments/bench_chain_mgpu.py --out "$OUT" 2>&1 \
    | grep -v "^WARNING\|^I0000" | tail -12
