#!/usr/bin/env bash
# One H200 call (issue 20), timings pipelined (n calls back to back, one sync): FlashAttention
# (ours, its variants, cuDNN, tokamax) in 3 rounds; paged decode tilings; the 1b train step
# with cuDNN and with our attention, alternated twice.
#   OUT=$OUT bash experiments/gpu_call_mgpu_pipelined.sh     (from the repository root)
set -u
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .anchors/wheels/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:.anchors/stubs:.
timeout 260 python3 experiments/bench_attention_mgpu.py --part fa --pipelined --iters 20 --rounds 3 \
    --impls ours cudnn tokamax_mosaic ours_grid ours_bwd_autobar --budget 225 > "$OUT/fa.log" 2>&1
grep -A12 "====" "$OUT/fa.log"
timeout 110 python3 experiments/bench_attention_mgpu.py --part paged --pipelined --budget 90 \
    --paged-variants default legacy bk128_st2_autobar bk64_st4 bk64_st4_autobar bk64_st5 \
    > "$OUT/paged.log" 2>&1
grep -A8 "====" "$OUT/paged.log"
for round in 1 2; do
    for att in cudnn pallas; do
        timeout 75 python3 experiments/bench_train.py --presets 1b --steps 6 --set train.batch_size=24 \
            model.attention=$att --out "$OUT" --tag "_1b_${att}_r${round}" 2>&1 | tail -2
    done
done
