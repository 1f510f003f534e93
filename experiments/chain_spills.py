"""How many registers does the decode megakernel take, and does it spill?

Compiles the chain megakernel once for the 350m and 1b shapes (2 layers, norms, attention at
position 160; zero inputs); run under MOSAIC_GPU_DUMP_PTXAS (ptxas's registers and spills for
each kernel) or MOSAIC_GPU_DUMP_PTX (its PTX). `pallas_kernels` comes from the import path as
given (no repository root added), so a copy of another tree can be compiled by putting it first
on PYTHONPATH, to compare two versions of the kernel.

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/d python3 experiments/chain_spills.py   # one H200
    grep -hE "Used|spill stores" /tmp/d/*.ptxas
"""
import jax.numpy as jnp

from pallas_kernels.chain import kernel as cm

print(cm.__file__)
for D, N1, F in ((1024, 3072, 2816), (2048, 6144, 5632)):
    hd = D // 16

    def z(*shape):
        return jnp.zeros(shape, jnp.bfloat16)

    rope = jnp.concatenate([jnp.ones(hd // 2), jnp.zeros(hd // 2)])
    out = cm.chain_mgpu(jnp.ones((D,)), z(2, N1, D), z(2, D, D), z(2, 2 * F, D), z(2, D, F),
                        z(2, 2, 16, 320, hd), jnp.array([160], jnp.int32), rope, norm_eps=1e-5)
    out[0].block_until_ready()
