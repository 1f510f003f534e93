#!/usr/bin/env bash
# One H200 call (issue 20): the backward kernels' consumers at 240 registers (producer 32) beside
# 232 (producer 40): ptxas's spill report, GPU tests of the 240 form, forward+backward timed
# pipelined (best of 2 rounds) at 4k, 16k and 16k causal, both backward forms, and cuDNN.
#   OUT=$OUT bash experiments/gpu_call_bwd_regs.sh
source "$(dirname "$0")/gpu_env.sh"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 70 python3 experiments/mgpu_spills.py > "$OUT/spills.log" 2>&1
grep -iE "===|spill stores|Used [0-9]+ registers" "$OUT/spills.log" | head -16
gpu_tests 80 regs240_tests_h200.log tests/test_flash_attention.py -k "240_register"
timeout 260 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 \
    --cases 0 2 3 --impls ours_two_kernel ours_two_kernel_r240 ours_fused_bwd ours_fused_r240 cudnn \
    --budget 220 > "$OUT/fa.log" 2>&1
grep -i "error" "$OUT/fa.log" | head -5
python3 -c '
import json, sys
for r in json.load(open(sys.argv[1]))["attention"]:
    print(r["impl"], r["S"], r["causal"], "fwd", round(r.get("fwd_tflops", 0)),
          "fwd+bwd", round(r.get("fwdbwd_tflops", 0)), [f"{e:.1e}" for e in r.get("rel_err_vs_cudnn", [])])' "$OUT/attention_mgpu.json"
pack_out
