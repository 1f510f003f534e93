#!/usr/bin/env bash
# One H200 call (issue 19): the chain megakernel's product splits swept (sweep_chain_splits.py:
# the cost model's against overrides of gate|up's and down's; kernel alone; SWEEP_PRESETS),
# after (MEGAKERNEL_TESTS=1) the decode hook's GPU tests and (DECODE_PRESETS) whole batch-1
# decode steps, chain against the fast path.
#   OUT=$OUT bash experiments/gpu_call_chain_splits.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${MEGAKERNEL_TESTS:-}" ]; then  # the decode hook's GPU tests first
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -x -q \
        -p no:cacheprovider tests/test_megakernel_decode.py > "$OUT/megakernel_tests_h200.log" 2>&1
    echo "megakernel decode tests rc=$?"; tail -2 "$OUT/megakernel_tests_h200.log"
fi
if [ -n "${DECODE_PRESETS:-}" ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_S:-150} python3 experiments/decode_floor.py \
        --presets $DECODE_PRESETS --batches 1 --variants chain fast --reps 3 --out "$OUT" > "$OUT/decode.log" 2>&1
    echo "decode rc=$?"; grep "^| \|read-only\|Error\|error" "$OUT/decode.log" | cut -c1-300 | tail -8
fi
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SWEEP_S:-240} python3 experiments/sweep_chain_splits.py \
    --presets ${SWEEP_PRESETS:-350m 1b} --variants ${SWEEP_VARIANTS:-0} --out "$OUT" 2>&1 \
    | grep -v "^WARNING\|^I0000" | tail -16
rm -f "$OUT/pip.log"
