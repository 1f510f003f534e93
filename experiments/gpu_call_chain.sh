#!/usr/bin/env bash
# One H200 call: the decode chain megakernel at the presets' shapes, its output against XLA's
# chain (printed first), then timed beside XLA and the floor; then its tests compiled.
#   OUT=$OUT bash experiments/gpu_call_chain.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_S:-240} python3 experiments/bench_chain_mgpu.py \
    --rounds 2 --iters 10 --out "$OUT" 2>&1 | grep -v "^WARNING\|^I0000" | tail -12
mkdir -p "$OUT/norms"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_S:-240} python3 experiments/bench_chain_mgpu.py --norms \
    --rounds 2 --iters 10 --out "$OUT/norms" 2>&1 | grep -v "^WARNING\|^I0000" | tail -12
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TESTS_S:-120} python3 -m pytest -x -v \
    -p no:cacheprovider tests/test_chain_mgpu.py -k on_the_gpu > "$OUT/chain_tests_h200.log" 2>&1
echo "tests rc=$?"; grep -E "PASS|FAIL|ERROR|passed|failed" "$OUT/chain_tests_h200.log" | tail -16
