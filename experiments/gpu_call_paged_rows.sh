#!/usr/bin/env bash
# One H200 call (issue 20): the paged kernel with Q and O moved as the group's G rows (no XLA
# pad of the group to 8 rows, no slice after the kernel): its tests compiled, then the five
# paged shapes timed pipelined, best of 2 rounds, alternating this kernel with the one before
# (edc32c1, carried as .anchors/paged_attention_mgpu_before.py) in separate processes:
# new, before, new, before.
#   OUT=$OUT bash experiments/gpu_call_paged_rows.sh     (from the repository root)
# Make the "before" copy first, here: git show edc32c1:pallas_kernels/paged_attention_mgpu.py \
#   > .anchors/paged_attention_mgpu_before.py   (.anchors/ is carried: git-ignored)
source "$(dirname "$0")/gpu_env.sh"
before_tree
gpu_tests 150 paged_tests_h200.log tests/test_paged_attention.py
n=0
for run in new before new before; do
    mkdir -p "$OUT/$run$((++n))"
    if [ $run = before ]; then pp=$BEFORE_PATH; else pp=$PYTHONPATH; fi
    PYTHONPATH=$pp OUT="$OUT/$run$n" timeout 100 python3 experiments/bench_attention_mgpu.py --part paged \
        --pipelined --budget 80 --paged-rounds 2 --paged-variants default bk128_st2_streamonly \
        > "$OUT/$run$n/paged.log" 2>&1
    echo "== $run ($n): $(paged_module "$pp")"
    grep -A6 "====" "$OUT/$run$n/paged.log"
done
pack_out
