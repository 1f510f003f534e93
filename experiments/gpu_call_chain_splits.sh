#!/usr/bin/env bash
# One H200 call (issue 19): the chain megakernel's product splits swept (sweep_chain_splits.py:
# the cost model's against overrides of gate|up's and down's), kernel alone, 350m and 1b.
#   OUT=$OUT bash experiments/gpu_call_chain_splits.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SWEEP_S:-240} python3 experiments/sweep_chain_splits.py \
    --out "$OUT" 2>&1 | grep -v "^WARNING\|^I0000" | tail -16
rm -f "$OUT/pip.log"
