#!/usr/bin/env bash
# One H200 call (2026-12-02, morning): the persistent forward with a causal mask (one block per
# SM running pairs of one head's query tiles, qi and n_qt - 1 - qi: equal K/V steps per pair)
# (ours, the default now) against one block per tile (ours_grid) and cuDNN, at the 1b step's
# attention (2k causal, batch 24 and 8) and the causal D 128 cases; its tests compiled. Run at
# c3bd581, when the pairs were the variant "ours_persistent" and "ours" one block per tile.
#   OUT=$OUT bash experiments/gpu_call_persistent_causal.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 120 persistent_tests_h200.log tests/test_flash_attention.py tests/test_mgpu_lowering.py -k persistent
timeout 300 python3 experiments/bench_attention_mgpu.py --part fa --cases 11 10 1 3 4 \
    --impls ours ours_grid cudnn --pipelined --rounds 2 --iters 10 > "$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log"
fa_rows "$OUT/attention_mgpu.json"
