#!/usr/bin/env bash
# One H200 call (issue 19): whole decode steps at batch 1 (350m, 1b; the default fast path)
# under XLA's programmatic-dependent-launch flags (PDL: a kernel's prologue overlaps the
# previous kernel's tail on Hopper) and command-buffer settings, each in its own process.
#   OUT=$OUT bash experiments/gpu_call_decode_flags.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
run() {  # run TAG FLAGS...
    local tag=$1; shift
    mkdir -p "$OUT/$tag"
    XLA_FLAGS="$*" timeout 110 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 \
        --variants fast --reps 3 --out "$OUT/$tag" > "$OUT/$tag/decode.log" 2>&1
    echo "== $tag: $*"; grep "^| 350m\|^| 1b\|Error\|error" "$OUT/$tag/decode.log" | head -4
}
run default
run pdl_off --xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false
run pdl_on --xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true
run pdl_on_cmdbuf_all --xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true \
    --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1
