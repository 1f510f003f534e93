#!/usr/bin/env bash
# One H200 call: the chain megakernel's PTX and ptxas report (registers, spills) for the 1b
# and 350m shapes with attention and norms, for this tree and (OLD=dir) another copy of
# pallas_kernels, gzipped to $OUT/<tree>_<kernel>.{ptx,ptxas}.gz.
#   OUT=$OUT OLD=.anchors/old bash experiments/gpu_call_chain_dump.sh
source "$(dirname "$0")/gpu_env.sh"
ROOT=$(pwd)
dump() {  # dump NAME PYTHONPATH_PREFIX
    local d=/tmp/dump_$1; rm -rf $d; mkdir -p $d
    (cd $d && PYTHONPATH=$ROOT/$2:$ROOT MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$d \
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 $ROOT/experiments/compile_chain.py > $d/log 2>&1)
    tail -1 $d/log | cut -c1-200
    for f in $d/*.ptx $d/*.ptxas; do gzip -c $f > "$OUT/$1_$(basename $f).gz"; done
    grep -h "registers\|spill" $d/*.ptxas | cut -c1-200
}
dump new .
[ -n "${OLD:-}" ] && dump old "$OLD"
