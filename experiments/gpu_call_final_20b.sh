#!/usr/bin/env bash
# One H200 call (issue 20): the defaults of 2026-12-02 (fused backward at 240 / 24 registers from
# 8k keys, every kernel ending on its stores' reads) beside cuDNN and tokamax, forward+backward
# pipelined, best of 2 rounds, at 4k, 4k causal, 16k, 16k causal, 4k causal GQA 32/8 and 2k causal
# (the 1b preset's attention); beside them the same with the old end wait ("endwait_writes") and
# the fused dQ summed heads-major ("hm"). Then the 1b training step, cuDNN against ours,
# alternated twice. Run gpu_call_kernel_suite.sh right after (warm machine).
#   OUT=$OUT bash experiments/gpu_call_final_20b.sh
source "$(dirname "$0")/gpu_env.sh"
timeout 200 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 3 10 1 4 --budget 185 --impls ours ours_endwait_writes ours_fused_bwd_hm cudnn \
    tokamax_mosaic > "$OUT/fa.log" 2>&1
grep -i "error" "$OUT/fa.log" | head -5
fa_rows "$OUT/attention_mgpu.json"
train_1b_alternated
pack_out
