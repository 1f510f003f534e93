#!/usr/bin/env bash
# One H200 call: every Mosaic GPU kernel's tests compiled (FlashAttention forward and backward,
# paged decode, the matrix-vector kernel, their sm90 lowering), the decode paths that call the
# paged kernel (test_paged_decode.py, test_decode_fast.py), then whole decode steps at batch 1
# (350m, 1b; the default fast path) with this paged kernel and with the one before its Q/O
# change (edc32c1, carried as .anchors/paged_attention_mgpu_before.py), in separate processes.
#   OUT=$OUT bash experiments/gpu_call_kernels_decode.sh    (from the repository root)
# Make the "before" copy first, here: git show edc32c1:pallas_kernels/paged_attention_mgpu.py \
#   > .anchors/paged_attention_mgpu_before.py   (.anchors/ is carried: git-ignored)
source "$(dirname "$0")/gpu_env.sh"
before_tree
kernel_suite 240
gpu_tests 120 paged_decode_tests_h200.log tests/test_paged_decode.py tests/test_decode_fast.py
for run in new before; do
    mkdir -p "$OUT/decode_$run"
    if [ $run = before ]; then pp=$BEFORE_PATH; else pp=$PYTHONPATH; fi
    echo "== $run: $(paged_module "$pp")"
    PYTHONPATH=$pp timeout 110 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 \
        --variants fast --reps 3 --out "$OUT/decode_$run" > "$OUT/decode_$run/decode.log" 2>&1
    grep "^| 350m\|^| 1b\|Error\|error" "$OUT/decode_$run/decode.log" | head -4
done
pack_out
