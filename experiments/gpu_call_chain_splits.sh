#!/usr/bin/env bash
# One H200 call (issue 19): the chain megakernel's product splits swept (sweep_chain_splits.py:
# the cost model's against overrides of gate|up's and down's; kernel alone; SWEEP_PRESETS),
# then whole batch-1 decode steps, chain against the fast path (DECODE_PRESETS; none: skip).
#   OUT=$OUT bash experiments/gpu_call_chain_splits.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SWEEP_S:-240} python3 experiments/sweep_chain_splits.py \
    --presets ${SWEEP_PRESETS:-350m 1b} --out "$OUT" 2>&1 | grep -v "^WARNING\|^I0000" | tail -16
if [ -n "${DECODE_PRESETS:-}" ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_S:-150} python3 experiments/decode_floor.py \
        --presets $DECODE_PRESETS --batches 1 --variants chain fast --reps 3 --out "$OUT" > "$OUT/decode.log" 2>&1
    echo "decode rc=$?"; grep "^| \|read-only\|Error\|error" "$OUT/decode.log" | cut -c1-300 | tail -8
fi
rm -f "$OUT/pip.log"
