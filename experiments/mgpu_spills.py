"""Registers and spills of the Mosaic GPU FlashAttention kernels, from ptxas (one H200).

    MOSAIC_GPU_DUMP_PTXAS=1 python3 experiments/mgpu_spills.py 2>&1 | grep -iE "spill|registers"

Compiles forward + backward once at 4k (bf16, 16 heads, D 128), two-kernel and fused backward;
Mosaic GPU prints ptxas's verbose report for each kernel when MOSAIC_GPU_DUMP_PTXAS=1.
"""
import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes

q = jax.random.normal(jax.random.key(0), (1, 4096, 16, 128), jnp.bfloat16)
for fused in (False, True):
    blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(128), fused_bwd=fused)
    loss = lambda q, k, v, b=blocks: flash_attention(q, k, v, block_sizes=b, implementation="mosaic").astype(jnp.float32).sum()
    print(f"=== fused_bwd={fused}", flush=True)
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))
