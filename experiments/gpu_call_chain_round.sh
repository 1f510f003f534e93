#!/usr/bin/env bash
# One H200 call (issue 19) after a change to the chain megakernel: its GPU tests, its
# per-layer critical path from its own stamps (trace_chain.py), then whole batch-1 decode
# steps, chain against the fast path, in one process (decode_floor.py).
#   OUT=$OUT bash experiments/gpu_call_chain_round.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout ${TESTS_S:-150} python3 -m pytest -x -q \
    -p no:cacheprovider tests/test_chain_mgpu.py -k on_the_gpu > "$OUT/chain_tests_h200.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" "$OUT/chain_tests_h200.log" | tail -4
# the kernel's registers and spills (ptxas -v), both presets (the PTX: gpu_call_chain_dump.sh)
rm -rf /tmp/rdump; mkdir -p /tmp/rdump
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/rdump XLA_PYTHON_CLIENT_PREALLOCATE=false \
    PYTHONPATH=$(pwd):$PYTHONPATH timeout 120 python3 experiments/compile_chain.py > /tmp/rdump/compile.log 2>&1
grep -h "Used\|spill stores" /tmp/rdump/*.ptxas | tee "$OUT/ptxas.txt"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TRACE_S:-120} python3 experiments/trace_chain.py \
    --pos ${POS:-160} --calls 3 --out "$OUT" 2>&1 | grep -v "^WARNING\|^I0000" | tail -18
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${DECODE_S:-240} python3 experiments/decode_floor.py \
    --presets ${PRESETS:-350m 1b} --batches 1 --variants ${VARIANTS:-chain fast} --reps 3 --out "$OUT" \
    > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep "^| \|read-only\|Error\|error" "$OUT/decode.log" | cut -c1-300 | tail -10
rm -f "$OUT"/trace_*.png "$OUT/pip.log"  # (at most 8 files come back; the plots are redrawn from the .npy)
