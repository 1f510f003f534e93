#!/usr/bin/env bash
# One H200 call: the Mosaic GPU matrix-vector kernel's tests compiled, then the kernel timed
# against XLA's product and a read-only sum over the same weights (the 350m and 1b decode
# shapes; kernel time from a profile, as a decode step's CUDA graph pays it).
#   OUT=$OUT bash experiments/gpu_call_matvec.sh    (from the repository root)
# The committed decode-step rows (`decode_floor_matvec_mgpu_h200.json`: variants fast and
# fast_mv, --profile-all) came from this script at commit 123ede2, where the decode path
# could take the kernel.
source "$(dirname "$0")/gpu_env.sh"
gpu_tests 100 matvec_tests_h200.log tests/test_matvec_mgpu.py
timeout 150 python3 experiments/bench_matvec_mgpu.py --out "$OUT" --copy-bytes 128e6 --program-bytes 128e6 \
    --variants n128_kc128_st4_s1 n128_kc128_st4_s2 n64_kc256_st3 n64_kc128_st4 --budget 120 > "$OUT/matvec.log" 2>&1
grep -A20 "====" "$OUT/matvec.log"
