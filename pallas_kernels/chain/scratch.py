"""The decode megakernel's shared memory (`kernel.kernel_call`'s scratch), one buffer or
barrier a line, in the order the kernel unpacks them; `resolve.smem_need` and
`resolve.attention_smem` count their bytes against the SM's limit. An option that is off
leaves None in its place, so that every position keeps its meaning."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import tiled_smem
from pallas_kernels.chain.attention import RED
from pallas_kernels.chain.plan import KC, T
from pallas_kernels.chain.resolve import window_rows


def shared_memory(kmax: int, stages: int, tiles: int, layers: int, *, head: bool, greedy: bool,
                  attention: tuple[int, int, int, int] | None) -> tuple:
    """The scratch of a kernel whose widest input is kmax chunks, with a ring of `stages`
    weight tiles, `tiles` tile pieces a block and `layers` layers; head: the output layer
    inside; greedy: greedy steps; attention: (S cached positions, head_dim, query heads a
    block, splits a query group), or None."""
    att = (None,) * 8
    if attention is not None:
        S, hd, GB, R = attention
        att = (
            tiled_smem((8 * (S // T), KC), jnp.bfloat16),  # p, as the tensor core reads it
            plgpu.SMEM((GB, S // T, T), jnp.float32),  # the scores, a query head each
            plgpu.SMEM(((GB + 2) * hd,), jnp.float32),  # the query heads' q, the k, the v
            plgpu.SMEM((GB * RED,), jnp.float32),  # the warps' partial sums
            plgpu.SMEM((hd,), jnp.float32),  # the angles (cos | sin)
            plgpu.Barrier(num_barriers=1),  # the angles landed
            plgpu.SMEM((GB, T), jnp.float32),  # a chunk of each query head's output
            plgpu.SMEM((GB, T), jnp.float32) if R > 1 else None,  # and its split's lse, at every column
        )
    return (
        tiled_smem((window_rows(kmax), KC), jnp.bfloat16),  # the input window
        tiled_smem((stages, T, KC), jnp.bfloat16),  # the weight ring
        plgpu.SMEM((tiles, T), jnp.float32),  # the tile pieces' 64 outputs, for their LL words
        plgpu.SMEM((T,), jnp.float32),  # the final chunk
        plgpu.SMEM((4,), jnp.float32),  # a norm's 4 warp partial sums of squares
        plgpu.Barrier(num_barriers=stages),  # slot's tile landed
        plgpu.Barrier(num_barriers=stages),  # slot free again
        plgpu.SMEM((2, T), jnp.float32) if head else None,  # the head's tiles, to z
    ) + att + ((
        plgpu.SMEM((2, T), jnp.float32),  # each column's best value and row (`greedy.track`)
        plgpu.SMEM((8,), jnp.float32),  # the warps' best pairs
        plgpu.SMEM((4,), jnp.int32),  # the step's token
        plgpu.Barrier(num_barriers=layers),  # layer l's new k and v of the step written (attention blocks)
    ) if greedy else (None,) * 4)
