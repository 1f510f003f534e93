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
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -c "
import jax, jax.numpy as jnp
import pallas_kernels.chain_mgpu as cm; print(cm.__file__)
for D, N1, F in ((1024, 3072, 2816), (2048, 6144, 5632)):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    hd = D // 16
    rope = jnp.concatenate([jnp.ones(hd // 2), jnp.zeros(hd // 2)])
    out = cm.chain_mgpu(jnp.ones((D,)), z(2, N1, D), z(2, D, D), z(2, 2 * F, D), z(2, D, F), z(2, 2, 16, 320, hd),
                        jnp.array([160], jnp.int32), rope, norm_eps=1e-5)
    out[0].block_until_ready()
" > $d/log 2>&1)
    tail -1 $d/log | cut -c1-200
    for f in $d/*.ptx $d/*.ptxas; do gzip -c $f > "$OUT/$1_$(basename $f).gz"; done
    grep -h "registers\|spill" $d/*.ptxas | cut -c1-200
}
dump new .
[ -n "${OLD:-}" ] && dump old "$OLD"
