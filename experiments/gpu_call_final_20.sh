#!/usr/bin/env bash
# One H200 call: the Mosaic GPU kernel tests compiled, FlashAttention against cuDNN and tokamax
# again (pipelined, 3 rounds), and the decode floor with the bandwidth measured both ways
# (synced and pipelined).
#   OUT=$OUT bash experiments/gpu_call_final_20.sh     (from the repository root)
source "$(dirname "$0")/gpu_env.sh"
mgpu_tests 150
timeout 185 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 20 --rounds 3 \
    --impls ours cudnn tokamax_mosaic --budget 150 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
timeout 140 python3 experiments/decode_floor.py --presets 350m 1b --batches 1 64 --variants fast \
    --budget-s 100 --out "$OUT" > "$OUT/decode_floor.log" 2>&1
tail -8 "$OUT/decode_floor.log"
