#!/usr/bin/env bash
# One H200 call (2026-12-02, morning): why our attention kernels run ~21% slower inside the 1b
# training step than alone (cuDNN's ~8%), with SM clock and board power sampled by nvidia-smi
# throughout (smi.csv; phases.txt gives each phase's start, unix seconds):
#  1. attention_in_step.py: ours / cuDNN / ours fused at the step's shape, alone and after
#     ~20 ms of matmuls or of memory-bound passes (issue 20);
#  2. the 1b step, cuDNN and ours, XLA's command buffers on and off (issue 20's 1b bar);
#  3. decode steps at batch 1 with the one-row products left as dots, run as Triton GEMMs or
#     cuBLASLt (issue 19; the lead of gpu_call_decode_matvec_flags.sh, removed: batch 64 left out).
#   OUT=$OUT bash experiments/gpu_call_in_step.sh        (from the repository root, .anchors/ carried)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 100 > "$OUT/smi.csv" 2>&1 &
SMI=$!
phase() { echo "$(date +%s.%N) $*" >> "$OUT/phases.txt"; echo "== $*"; }
phase attention_in_step
timeout 170 python3 experiments/attention_in_step.py --out "$OUT" 2>&1 | grep -v "^WARNING" | tail -22
for flags in "" "--xla_gpu_enable_command_buffer="; do
    tag=$([ -z "$flags" ] && echo cmdbuf || echo nocmdbuf)
    for att in cudnn pallas; do
        phase "train_1b_${att}_${tag}"
        XLA_FLAGS=$flags timeout 70 python3 experiments/bench_train.py --presets 1b --steps 8 \
            --set train.batch_size=24 model.attention=$att --out "$OUT" \
            --tag "_1b_${att}_${tag}" 2>&1 | tail -1
    done
done
decode() {  # decode TAG FLAGS...
    local tag=$1; shift
    phase "decode_$tag"
    mkdir -p "$OUT/decode_$tag"
    XLA_FLAGS="$*" timeout 75 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 \
        --variants fast --reps 3 --out "$OUT/decode_$tag" > "$OUT/decode_$tag/decode.log" 2>&1
    grep "^| 350m\|^| 1b\|Error\|error" "$OUT/decode_$tag/decode.log" | head -4
}
decode default
decode dots_triton --xla_disable_hlo_passes=dot-strength-reduction
decode dots_cublas --xla_disable_hlo_passes=dot-strength-reduction --xla_gpu_enable_triton_gemm=false
phase end
kill $SMI
pack_out
