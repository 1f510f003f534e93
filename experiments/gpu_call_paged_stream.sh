#!/usr/bin/env bash
# One H200 call (issue 20): the paged kernel's tests compiled, then the five paged shapes timed
# pipelined, best of 2 rounds: the stream-K default beside the previous default (a grid of
# context splits in whole waves, "waves"), shares in whole items only and as even as can be, and the page
# stream alone (no math) as a probe of the kernel's ceiling.
#   OUT=$OUT bash experiments/gpu_call_paged_stream.sh     (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 150 paged_tests_h200.log tests/test_paged_attention.py
timeout 200 python3 experiments/bench_attention_mgpu.py --part paged --pipelined --budget 170 \
    --paged-rounds 2 --paged-variants default bk128_st2_whole bk128_st2_even waves bk128_st2_streamonly \
    > "$OUT/paged.log" 2>&1
grep -A8 "====" "$OUT/paged.log"
