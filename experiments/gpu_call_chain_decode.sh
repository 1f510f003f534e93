#!/usr/bin/env bash
# One H200 call (issue 19): whole batch-1 decode steps (350m, 1b; 32-token prompt, 256 new
# tokens, greedy) through the default fast path and through the chain megakernel
# (`gendist.inference.megakernel`), against the floor, in one process.
#   OUT=$OUT bash experiments/gpu_call_chain_decode.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_S:-400} python3 experiments/decode_floor.py \
    --presets ${PRESETS:-350m 1b} --batches 1 --variants ${VARIANTS:-chain fast} --reps 3 --out "$OUT" \
    > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep "^| \|read-only\|Error\|error" "$OUT/decode.log" | cut -c1-400 | tail -12
