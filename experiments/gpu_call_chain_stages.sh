#!/usr/bin/env bash
# One H200 call (issue 19): where the chain megakernel's layer time goes. Its attention GPU
# tests; the kernel alone with norms, without attention and with attention at the positions
# POS_LIST (default 0 160), each at the ring depths STAGES_LIST (16 24: TMA tiles a block
# buffers while it waits on a handover); whole batch-1 decode steps before the sweep.
#   OUT=$OUT bash experiments/gpu_call_chain_stages.sh
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout 90 python3 -m pytest -x -q \
    -p no:cacheprovider tests/test_chain_mgpu.py -k on_the_gpu > "$OUT/chain_tests_h200.log" 2>&1
echo "chain GPU tests rc=$?"; tail -2 "$OUT/chain_tests_h200.log"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_S:-200} python3 experiments/decode_floor.py \
    --presets 350m 1b --batches 1 --variants ${VARIANTS:-chain@16 chain@24 fast} --reps 3 --out "$OUT" \
    > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep "^| \|read-only\|Error\|error" "$OUT/decode.log" | cut -c1-400 | tail -12
for st in ${STAGES_LIST:-16 24}; do
    for pos in ${POS_LIST:-0 160}; do
        mkdir -p "$OUT/st${st}_pos$pos"
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 experiments/bench_chain_mgpu.py --norms \
            --attention $pos --stages $st --rounds 2 --iters 10 --out "$OUT/st${st}_pos$pos" 2>&1 \
            | grep "ours\|rel err\|layers;" | sed "s/^/st$st pos$pos /" | cut -c1-100
    done
done
pack_out
