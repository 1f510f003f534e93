"""Registers and spills of the Mosaic GPU FlashAttention kernels, from ptxas.

On one H200:

    MOSAIC_GPU_DUMP_PTXAS=1 python3 experiments/mgpu_spills.py 2>&1 | grep -iE "===|spill|registers"

On a machine without a GPU (a deviceless compile for an H200, `decode_hlo_h200.py`'s target
config; the report matched the H200's byte for byte, 2026-12-02: the fused backward spills
184 / 208 bytes at 232 registers a consumer, 120 / 132 at 240), with the CUDA plugin and ptxas
from pip:

    pip install --no-deps --target /tmp/cuda_aot jax-cuda13-pjrt==$JAXVER jax-cuda13-plugin==$JAXVER \\
        "nvidia-cuda-nvcc==13.0.*"
    PATH=/tmp/cuda_aot/nvidia/cu13/bin:$PATH PYTHONPATH=.:/tmp/cuda_aot MOSAIC_GPU_DUMP_PTXAS=1 \\
        python3 experiments/mgpu_spills.py --aot 2>&1 | grep -iE "===|spill|registers"

Compiles forward + backward once at 4k (bf16, 16 heads, D 128), the two-kernel and the fused
backward (6 s a form without a GPU); Mosaic GPU prints ptxas's verbose report for each kernel
when MOSAIC_GPU_DUMP_PTXAS=1.
"""
import argparse
import dataclasses
import os
import sys

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--aot", action="store_true", help="deviceless compile for an H200 (no GPU here)")
parser.add_argument("--forms", nargs="*", default=["two", "fused"], choices=["two", "fused"],
                    help="backward forms to compile: the two kernels, the fused one")
parser.add_argument("--regs-bwd", type=int, default=None,
                    help="MosaicBlockSizes.regs_bwd (consumer registers of the backward)")
args = parser.parse_args()
if args.aot:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes  # noqa: E402

shape = (1, 4096, 16, 128)
if args.aot:
    sys.path.insert(0, os.path.dirname(__file__))
    from decode_hlo_h200 import h200_sharding

    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=h200_sharding())
for fused in [f == "fused" for f in args.forms]:
    blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(128), fused_bwd=fused)
    if args.regs_bwd is not None:
        blocks = dataclasses.replace(blocks, regs_bwd=args.regs_bwd)

    def loss(q, k, v, b=blocks):
        o = flash_attention(q, k, v, block_sizes=b, implementation="mosaic", interpret=False)
        return o.astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    print(f"=== fused_bwd={fused} regs_bwd={blocks.regs_bwd}", flush=True)
    if args.aot:
        grad.trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).compile()
    else:
        q = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        jax.block_until_ready(grad(q, q, q))
