#!/usr/bin/env bash
# One H200 call: the decode chain megakernel at the presets' shapes, its output against XLA's
# chain (printed first), then timed beside XLA and the floor: the weight chain alone, then
# with attention (16 heads, a 320-row cache read below position ATT_POS) and RMSNorms; then
# its tests compiled.
#   OUT=$OUT bash experiments/gpu_call_chain.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
bench() {  # bench DIR ARGS...: bench_chain_mgpu.py into $OUT/DIR
    mkdir -p "$OUT/$1"; local dir=$1; shift
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_S:-240} python3 experiments/bench_chain_mgpu.py \
        --rounds 2 --iters 10 --out "$OUT/$dir" "$@" 2>&1 | grep -v "^WARNING\|^I0000" | tail -12
}
bench chain
bench attention --norms --attention ${ATT_POS:-160}
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TESTS_S:-120} python3 -m pytest -x -v \
    -p no:cacheprovider tests/test_chain_mgpu.py -k on_the_gpu > "$OUT/chain_tests_h200.log" 2>&1
echo "tests rc=$?"; grep -E "PASS|FAIL|ERROR|passed|failed|Error" "$OUT/chain_tests_h200.log" | tail -16
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TESTS_S:-120} python3 -m pytest -x -q \
    -p no:cacheprovider tests/test_megakernel_decode.py > "$OUT/megakernel_tests_h200.log" 2>&1
echo "megakernel decode tests rc=$?"; tail -5 "$OUT/megakernel_tests_h200.log"
