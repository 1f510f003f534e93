#!/usr/bin/env bash
# One H200 call (issue 20, 2026-12-02 afternoon): the acceptance table at today's defaults
# (own causal steps and delta in the dQ kernel, commit 1a9d4f2 on): ours beside cuDNN and
# tokamax at 4k, 4k causal, 16k, 16k causal, 4k causal GQA 32/8 and the 1b step's attention
# (2k causal x 24), forward+backward pipelined, best of 3 rounds; then the FlashAttention and
# sm90-lowering tests compiled.
#   OUT=$OUT bash experiments/gpu_call_accept_20.sh    (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
timeout 250 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 3 \
    --cases 0 1 2 3 4 11 --budget 235 --impls ours cudnn tokamax_mosaic > "$OUT/bench.log" 2>&1
grep -i "error\|deadline" "$OUT/bench.log" | head -5
fa_rows "$OUT/attention_mgpu.json"
gpu_tests 290 fa_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_mgpu_lowering.py -k "mosaic or Mosaic or persistent or lower"
