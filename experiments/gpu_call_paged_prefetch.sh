#!/usr/bin/env bash
# One H200 call (issue 20): the paged kernel's tests compiled (among them a stream-K schedule
# with L2 prefetches), then the five paged shapes timed pipelined, best of 3 rounds: the
# default beside the producer prefetching pages 1, 2 or 4 steps ahead into L2, and the page
# stream alone (no math) without and with prefetches, as probes of the kernel's ceiling.
#   OUT=$OUT bash experiments/gpu_call_paged_prefetch.sh     (at 4ea0716: the prefetch is removed since,
#   it cost 11-40%: benchmarks/paged_attention_mgpu_h200_prefetch.json)
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 120 paged_tests_h200.log tests/test_paged_attention.py -k "mosaic or Mosaic or stream"
timeout 300 python3 experiments/bench_attention_mgpu.py --part paged --pipelined --budget 260 \
    --paged-rounds 3 --paged-variants default bk128_st2_pf1 bk128_st2_pf2 bk128_st2_pf4 \
    bk128_st2_streamonly bk128_st2_streamonly_pf2 > "$OUT/paged.log" 2>&1
grep -A8 "====" "$OUT/paged.log"
