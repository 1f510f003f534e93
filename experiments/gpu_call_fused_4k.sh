#!/usr/bin/env bash
# One H200 call (issue 20): why the fused backward runs ~20% slower per flop at 4k than at 16k
# (kernel time from a profile) while the two kernels run the same rate at both.
#  1. fused (its default 240 / 24 registers), two kernels (232 and 240), cuDNN, forward+backward pipelined
#     and profiled at 2k, 4k, 8k, 16k without a mask (16k tokens), at 4k as one sequence of 64
#     heads (the same work as 4k x 4 sequences of 16), and at 16k causal (MHA, GQA 32/8);
#  2. the same fused kernel with its dQ reduce-adds changed, timing only (its dQ is wrong):
#     plain stores instead of reduce-adds ("store"), or no dQ copies at all ("nodq").
#     The patched kernels live in a copy of pallas_kernels under /tmp/diag_*.
#   OUT=$OUT bash experiments/gpu_call_fused_4k.sh
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT/main"
OUT=$OUT/main timeout 330 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 \
    --rounds 2 --cases 8 0 9 7 2 3 6 --profile --budget 300 \
    --impls ours_two_kernel ours_two_kernel_r240 ours_fused_bwd cudnn > "$OUT/fa_main.log" 2>&1
grep -i "error" "$OUT/fa_main.log" | head -5
fa_rows "$OUT/main/attention_mgpu.json"
for diag in store nodq; do
    mkdir -p /tmp/diag_$diag "$OUT/$diag" && cp -r pallas_kernels /tmp/diag_$diag/
    DIAG=$diag python3 - <<'PY'
import os, re
diag = os.environ["DIAG"]
p = f"/tmp/diag_{diag}/pallas_kernels/flash_attention_mgpu_bwd.py"
s = open(p).read()
old = re.search(r"plgpu\.copy_smem_to_gmem\(dq_tile, dst\.at\[:, cols\],\s*reduction_op=[^)]*\)", s).group(0)
new = {"store": "plgpu.copy_smem_to_gmem(dq_tile, dst.at[:, cols])", "nodq": "pass"}[diag]
open(p, "w").write(s.replace(old, new))
PY
    OUT=$OUT/$diag PYTHONPATH=/tmp/site:.anchors/stubs:/tmp/diag_$diag:. timeout 100 python3 \
        experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 --rounds 2 --cases 0 2 \
        --profile --budget 80 --impls ours_fused_bwd > "$OUT/fa_$diag.log" 2>&1
    echo "diag $diag rc $?"; fa_rows "$OUT/$diag/attention_mgpu.json"
done
pack_out
