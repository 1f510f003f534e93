#!/usr/bin/env bash
# One H200 call (issue 20): two cheap changes to the backward, timed forward+backward pipelined
# (best of 2 rounds) beside cuDNN at 4k and 16k (D 128, no mask), each form's kernels profiled:
#  - every kernel ends waiting only until its last TMA stores have read shared memory
#    (`end_wait_reads`, CUTLASS's epilogue) instead of until they land;
#  - the fused backward's consumers at 240 registers, the producer at 24 (`regs_bwd=240`,
#    FlashAttention-3's split; 240 / 32 hung: benchmarks/README.md). Run in a process of its
#    own after the others, so that a hang loses only its own rows.
#   OUT=$OUT bash experiments/gpu_call_bwd_endwait.sh
source "$(dirname "$0")/gpu_env.sh"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 40 python3 experiments/mgpu_spills.py --forms fused --regs-bwd 240 \
    > "$OUT/spills_r240.log" 2>&1
grep -iE "===|spill stores" "$OUT/spills_r240.log" | head -6
mkdir -p "$OUT/main" "$OUT/r240"
OUT=$OUT/main timeout 250 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 \
    --rounds 2 --cases 0 2 --profile --budget 230 --impls ours_two_kernel ours_two_kernel_endread \
    ours_fused_bwd ours_fused_bwd_endread cudnn > "$OUT/fa_main.log" 2>&1
grep -i "error" "$OUT/fa_main.log" | head -5
fa_rows "$OUT/main/attention_mgpu.json"
OUT=$OUT/r240 timeout 150 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 10 \
    --rounds 2 --cases 0 2 --budget 130 --impls ours_fused_bwd_r240 ours_fused_bwd_r240_endread cudnn \
    > "$OUT/fa_r240.log" 2>&1
echo "r240 rc $?"
grep -i "error" "$OUT/fa_r240.log" | head -5
fa_rows "$OUT/r240/attention_mgpu.json"
pack_out
