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

train_1b_alternated() {  # the 1b train step with cuDNN and with our attention, alternated twice
    for round in 1 2; do
        for att in cudnn pallas; do
            timeout 75 python3 experiments/bench_train.py --presets 1b --steps 6 --set train.batch_size=24 \
                model.attention=$att --out "$OUT" --tag "_1b_${att}_r${round}" 2>&1 | tail -1
        done
    done
}

pack_out() {  # at the end of a call: the device returns at most 8 files, so more go as one tarball
    if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
        tar czf /tmp/out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/out.tgz "$OUT/out.tgz"
        echo "(more than 8 files: they come back as out.tgz)"
    fi
}
