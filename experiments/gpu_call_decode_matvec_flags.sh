#!/usr/bin/env bash
# One H200 call (issue 19, not yet run): whole decode steps (350m, 1b; batch 1 and 64; the
# default fast path) with the one-row products left as dots instead of XLA's rewrite into a
# multiply + row reduction (its `dot-strength-reduction` pass, off), so that they run as
# Triton GEMMs, or (Triton GEMMs off too) as cuBLASLt matmuls. Deviceless H200 compile
# (decode_hlo_h200.py, 1b batch 1): 178 products become `__triton_nested_gemm_fusion`s,
# resp. `__cublas$lt$matmul` custom calls, no weight copied; whether either streams the
# weights faster than the reduction (2.2-3.1 TB/s on the 1b products) needs this call.
#   OUT=$OUT bash experiments/gpu_call_decode_matvec_flags.sh    (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
run() {  # run TAG FLAGS...
    local tag=$1; shift
    mkdir -p "$OUT/$tag"
    XLA_FLAGS="$*" timeout 150 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 64 \
        --variants fast --reps 3 --out "$OUT/$tag" > "$OUT/$tag/decode.log" 2>&1
    echo "== $tag: $*"; grep "^| 350m\|^| 1b\|Error\|error" "$OUT/$tag/decode.log" | head -6
}
run default
run dots_triton --xla_disable_hlo_passes=dot-strength-reduction
run dots_cublas --xla_disable_hlo_passes=dot-strength-reduction --xla_gpu_enable_triton_gemm=false
pack_out
