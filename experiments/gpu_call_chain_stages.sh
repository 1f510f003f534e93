#!/usr/bin/env bash
# One H200 call (issue 19): the chain megakernel's ring depth (TMA slots a block buffers while
# it waits on a handover), kernel alone (attention at position 160, norms) and whole batch-1
# decode steps.   OUT=$OUT bash experiments/gpu_call_chain_stages.sh
source "$(dirname "$0")/gpu_env.sh"
for st in ${STAGES_LIST:-16 20 24}; do
    mkdir -p "$OUT/st$st"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 experiments/bench_chain_mgpu.py --norms --attention 160 \
        --stages $st --rounds 2 --iters 10 --out "$OUT/st$st" 2>&1 | grep "ours\|err" | sed "s/^/st$st /"
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_S:-300} python3 experiments/decode_floor.py \
    --presets 350m 1b --batches 1 --variants ${VARIANTS:-chain@16 chain@24 fast} --reps 3 --out "$OUT" \
    > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep "^| \|read-only\|Error\|error" "$OUT/decode.log" | cut -c1-400 | tail -12
