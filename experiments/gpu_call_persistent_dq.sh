#!/usr/bin/env bash
# One H200 call (2026-12-02, morning): the dQ kernel on the persistent schedule (pairs of one
# head's query tiles when causal; now the default) beside one block per tile (ours_dq_grid),
# the forward's old causal grid (ours_grid) and cuDNN, at the 1b step's attention (2k causal,
# batch 24 and 8), 4k with and without a mask and 4k causal GQA; the 1b step with cuDNN and
# ours; the FlashAttention kernel tests compiled.
#   OUT=$OUT bash experiments/gpu_call_persistent_dq.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
timeout 220 python3 experiments/bench_attention_mgpu.py --part fa --cases 11 10 0 1 4 \
    --impls ours ours_dq_grid ours_grid cudnn --pipelined --rounds 2 --iters 10 > "$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log"
fa_rows "$OUT/attention_mgpu.json"
for att in cudnn pallas; do
    timeout 70 python3 experiments/bench_train.py --presets 1b --steps 8 --set train.batch_size=24 \
        model.attention=$att --out "$OUT" --tag "_1b_${att}" 2>&1 | tail -1
done
gpu_tests 160 fa_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_mgpu_lowering.py -k "mosaic or Mosaic or persistent or lower"
