"""The Mosaic GPU kernels lowered for an sm90 GPU on a host without one.

Lowering runs Mosaic GPU's own checks (tile-aligned shared-memory slices, 16-byte global
strides for TMA, layouts, register operands of wgmma) that the CPU interpreter skips; it
stops before PTX, so what only the hardware shows (alignment of shared-memory addresses,
deadlocks, speed) stays for the GPU runs. Real GPU kernels, the GPU path of each: P and dS
from registers, named barriers, TMA reduce-add."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import lowered_for_sm90

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes
from pallas_kernels.paged_attention_mgpu import PagedBlockSizes, paged_attention_mgpu

BF16 = jnp.bfloat16


def mosaic_kernels(lowered: str) -> int:
    """Mosaic GPU kernels in a program's text lowered for a CUDA GPU (`lowered_for_sm90`)."""
    return lowered.count("stablehlo.custom_call @mosaic_gpu")


# (seq, q heads, kv heads, head dim, causal, MosaicBlockSizes changes). At head dim 128 the
# defaults here take the backward through dS in global memory (`ds_in_hbm`: the dK/dV kernel
# storing dS^T, then dQ from dS); the two-kernel form is lowered with it turned off.
FA = [(4096, 16, 16, 128, False, {}), (2048, 32, 8, 128, True, {}),
      (1024, 8, 8, 64, True, dict(fused_bwd=True)), (2048, 8, 8, 128, False, dict(fused_bwd=True)),
      (1024, 8, 8, 64, False, dict(ds_in_hbm=True)),
      # causal: the persistent forward (the default) and dQ kernel (pairs)
      (2048, 16, 16, 128, True, dict(persistent_dq=True, ds_in_hbm=False)),
      (1024, 16, 16, 128, False, dict(persistent_dq=True, ds_in_hbm=False))]


@pytest.mark.parametrize("seq,heads,kv_heads,head_dim,causal,change", FA)
def test_flash_attention_forward_and_backward_lower_for_sm90(seq, heads, kv_heads, head_dim, causal, change):
    blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(head_dim), **change)

    def loss(q, k, v):
        o = flash_attention(q, k, v, causal=causal, block_sizes=blocks, implementation="mosaic",
                            interpret=False)
        return o.astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), BF16)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), BF16)
    text = lowered_for_sm90(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    kernels = mosaic_kernels(text)
    assert kernels == (2 if change.get("fused_bwd") else 3)  # forward, dQ (unless fused), dK/dV
    # at head dim 128 the default backward computes dQ from the stored dS^T
    ds = change.get("ds_in_hbm", head_dim == 128 and not change.get("fused_bwd"))
    assert ("flash_attention_bwd_dq_from_ds" in text) == ds


# (batch, q heads, kv heads, page size, table columns, PagedBlockSizes): whole items, split
# items (few long sequences), a table width that is not a multiple of 4 (padded), GQA 1.
PAGED = [(64, 32, 8, 16, 256, PagedBlockSizes()), (4, 64, 8, 16, 2048, PagedBlockSizes()),
         (5, 8, 8, 64, 37, PagedBlockSizes(split_items=True)), (3, 16, 2, 32, 100, PagedBlockSizes(num_splits=3))]


@pytest.mark.parametrize("batch,heads,kv_heads,page,columns,sizes", PAGED)
def test_paged_attention_lowers_for_sm90(batch, heads, kv_heads, page, columns, sizes):
    q = jax.ShapeDtypeStruct((batch, heads, 128), BF16)
    pages = jax.ShapeDtypeStruct((kv_heads, batch * columns, page, 128), BF16)
    tables = jax.ShapeDtypeStruct((batch, columns), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    paged = lambda *a: paged_attention_mgpu(*a, sm_scale=0.088, block_sizes=sizes)  # noqa: E731
    assert mosaic_kernels(lowered_for_sm90(paged, q, pages, pages, tables, lengths)) == 1
