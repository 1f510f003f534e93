# Sourced by experiments/gpu_call_*.sh (one H200 call each, from the repository root, with
# `.anchors/` a copy of ../shared/anchors): makes $OUT, installs the peers' wheels (tokamax),
# sets PYTHONPATH, and defines the steps the calls share.
set -u
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .anchors/wheels/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:.anchors/stubs:.

gpu_tests() {  # gpu_tests SECONDS LOG PYTEST_ARGS...: tests compiled on the GPU, log in $OUT/LOG
    local seconds=$1 log=$2; shift 2
    XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda timeout "$seconds" python3 -m pytest -n 4 -q -rA \
        -p no:cacheprovider "$@" > "$OUT/$log" 2>&1
    tail -4 "$OUT/$log"
}

mgpu_tests() {  # mgpu_tests SECONDS: the Mosaic GPU kernel tests compiled, log in $OUT
    gpu_tests "$1" kernel_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_paged_attention.py \
        -k "mosaic or Mosaic or linearly"
}

kernel_suite() {  # kernel_suite SECONDS: every Mosaic GPU kernel's tests compiled (FlashAttention,
    # paged decode, the matrix-vector kernel, their sm90 lowering), log in $OUT
    gpu_tests "$1" kernel_tests_mgpu_h200.log tests/test_flash_attention.py tests/test_paged_attention.py \
        tests/test_matvec_mgpu.py tests/test_mgpu_lowering.py -k "mosaic or Mosaic or linearly or matvec or lower"
}

before_tree() {  # the paged kernel before its Q/O change (edc32c1) in a copy of pallas_kernels under
    # /tmp/before; BEFORE_PATH puts it first. Make the copy first, on this machine:
    #   git show edc32c1:pallas_kernels/paged_attention_mgpu.py > .anchors/paged_attention_mgpu_before.py
    [ -f .anchors/paged_attention_mgpu_before.py ] || {
        echo "missing .anchors/paged_attention_mgpu_before.py (see before_tree in gpu_env.sh)" >&2; exit 2; }
    mkdir -p /tmp/before && cp -r pallas_kernels /tmp/before/ &&
        cp .anchors/paged_attention_mgpu_before.py /tmp/before/pallas_kernels/paged_attention_mgpu.py
    BEFORE_PATH=/tmp/site:.anchors/stubs:/tmp/before:.
}

paged_module() {  # paged_module PYTHONPATH: the paged kernel's file that path imports
    PYTHONPATH=$1 python3 -P -c 'import pallas_kernels.paged_attention_mgpu as m; print(m.__file__)'
}

train_1b() {  # train_1b TAG [KEY=VALUE...]: one run of the 1b train step (batch 24, 6 steps, its
    # own process) into $OUT/train_*_1b_TAG.json; cuDNN's attention if TAG starts with "cudnn",
    # else ours, its MosaicBlockSizes defaults replaced by the KEY=VALUEs (bench_train_blocks.py)
    local tag=$1 att=pallas; shift
    [ "${tag%%_*}" = cudnn ] && att=cudnn
    local args=(--presets 1b --steps 6 --set train.batch_size=24 model.attention=$att --out "$OUT" --tag "_1b_$tag")
    if [ $# -gt 0 ]; then
        timeout 85 python3 experiments/bench_train_blocks.py "$@" -- "${args[@]}" 2>&1 | tail -1
    else
        timeout 85 python3 experiments/bench_train.py "${args[@]}" 2>&1 | tail -1
    fi
}

train_1b_alternated() {  # train_1b_alternated [ROUNDS]: cuDNN's attention and ours, alternated (2)
    for round in $(seq "${1:-2}"); do
        train_1b "cudnn_r$round"
        train_1b "pallas_r$round"
    done
}

profile_1b() {  # profile_1b SECONDS: the 1b step (batch 24) profiled with cuDNN's attention and
    # with ours (kernel time by kind), each into $OUT/<attention>/ with its log in $OUT
    for att in cudnn pallas; do
        mkdir -p "$OUT/$att"
        timeout "$1" python3 experiments/profile_train.py --preset 1b --steps 3 \
            --set train.batch_size=24 model.attention=$att --out "$OUT/$att" > "$OUT/profile_$att.log" 2>&1
        echo "$att rc $?"; tail -12 "$OUT/profile_$att.log"
    done
}

fa_rows() {  # fa_rows JSON: bench_attention_mgpu.py's FlashAttention rows, one line each (TFLOP/s,
    # relative error of out, dQ, dK, dV against cuDNN's)
    python3 -c '
import json, sys
for r in json.load(open(sys.argv[1]))["attention"]:
    print(r["impl"], r["S"], r["causal"], r["N"], r["K"], "fwd", round(r.get("fwd_tflops", 0)),
          "fwd+bwd", round(r.get("fwdbwd_tflops", 0)), [f"{e:.1e}" for e in r.get("rel_err_vs_cudnn", [])])' "$1"
}

pack_out() {  # at the end of a call: the device returns at most 8 files, so more go as one tarball
    if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
        tar czf /tmp/out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/out.tgz "$OUT/out.tgz"
        echo "(more than 8 files: they come back as out.tgz)"
    fi
}
