#!/usr/bin/env bash
# One H200 call (issue 20): the fused backward (FlashAttention-3's split: both consumers' dS^T rows
# in a shared tile, each computes half of dQ's columns over the block's 128 keys, one step behind
# its dS^T, one fp32 reduce-add tile per (query tile, key block)) tested compiled on every GPU
# case, then forward+backward timed pipelined, best of 2 rounds: the two-kernel backward, the
# fused one, cuDNN, at the five D 128 cases.
#   OUT=$OUT bash experiments/gpu_call_fused_bwd2.sh
# (ef72134 ran the lockstep form at cases 0 2 3: attention_mgpu_h200_fused_split.json; 19a17dc
# its mbarrier / named-barrier and staggered variants: attention_mgpu_h200_fused_variants.json)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 130 fused_bwd_tests_h200.log tests/test_flash_attention.py -k "fused_backward"
bench=(--cases 0 1 2 3 4 --impls ours_two_kernel ours_fused_bwd cudnn --budget 260)
timeout 300 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    "${bench[@]}" > "$OUT/fa.log" 2>&1
grep -i "error" "$OUT/fa.log" | head -5
fa_rows "$OUT/attention_mgpu.json"
pack_out
