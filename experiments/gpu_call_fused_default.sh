#!/usr/bin/env bash
# One H200 call (issue 20): the fused backward as the default at head dim 128 from 8k keys on.
# ptxas's register / spill report of both backward forms, forward+backward timed pipelined (best
# of 2 rounds: two kernels, fused, cuDNN) at 4k, 16k, 16k causal and 16k causal GQA 32/8, then
# every Mosaic GPU kernel test compiled.
#   OUT=$OUT bash experiments/gpu_call_fused_default.sh
source "$(dirname "$0")/gpu_env.sh"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 experiments/mgpu_spills.py > "$OUT/spills.log" 2>&1
grep -iE "===|spill stores|Used [0-9]+ registers" "$OUT/spills.log" | head -12
timeout 240 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 3 6 --impls ours_two_kernel ours_fused_bwd cudnn --budget 200 > "$OUT/fa.log" 2>&1
grep -i "error" "$OUT/fa.log" | head -5
fa_rows "$OUT/attention_mgpu.json"
kernel_suite 250
pack_out
