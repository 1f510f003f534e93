"""`chain_mgpu`, the decode megakernel's entry point: a call's options resolved for its
shapes (`resolve`), the state a decode loop keeps between calls, and the kernel's results
in the order callers take them (`kernel.kernel_call` builds and launches the kernel)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.chain.kernel import kernel_call
from pallas_kernels.chain.resolve import Schedule, resolve


@functools.partial(jax.jit, static_argnames=("stages", "blocks", "norm_eps", "trace", "splits", "spare",
                                             "group", "prefetch", "tiles", "norm_sums", "packed", "inflight",
                                             "loads", "att_loads", "att_splits", "new_state",
                                             "advance", "steps"))
def chain_mgpu(x0_D, w_qkv, w_o, w_gu, w_down, kv=None, pos=None, rope=None, *, stages: int = 16,
               blocks: int | None = None, norm_eps: float | None = None, trace: bool = False,
               splits: tuple | None = None, spare: bool | None = None, group: int | None = None,
               prefetch: int = 0, tiles: int = 1, norm_sums: bool = True, packed: bool = True,
               w_head=None, inflight: int = 1, loads: int | None = None, state=None,
               new_state: bool = False, embed=None, advance: bool = False, att_loads: int | None = None,
               att_splits: int = 1, steps: int = 1):
    """fp32 x_L [D] of the module docstring's chain from fp32 x_0 [D]: one persistent kernel
    (GPU only: sm90). norm_eps: with RMSNorms before q|k|v and gate|up, their gains already
    folded into w_qkv's and w_gu's columns (`xla.fold_norms`); None: no norms.

    With kv [L, 2, H, S, hd] (bf16 K and V caches of H kv heads, finite), pos [1] int32 (the
    new token's position: the cache rows below it are read) and rope [hd] fp32 (cos | sin of
    its angles, `gendist.models.layers.rope_angles`) or [R >= S, hd] (every position's: the
    kernel reads row pos, so that no kernel before it computes the angles), each layer
    attends (`attention`: D / hd query heads, query head i reading kv head i // (D / hd / H);
    w_qkv's rows are q | k | v, N1 = D + 2 H hd) and the result is (x_L, kv_new [L, 2, H, hd]
    bf16: the new token's rotated k and its v, for the caller to write at row pos).

    trace=True adds a last output [blocks, steps L, len(TRACE_POINTS), 2] int32: each block's
    {globaltimer ns (low 32 bits), SM clock} at `TRACE_POINTS` of every layer of every step
    (step t's layer l at t L + l; 0 where the block never reaches the point): what
    `experiments/trace_chain.py` reads. splits:
    ((product, sk, st), ...) instead of `plan.choose_split`'s for those products. spare: o
    is split over the blocks that do not attend (`plan.products`' att_blocks); False: over
    all of them. None (either): as measured fastest for the shape (`plan.tuned`). group: query
    heads a block attends with, dividing the query heads a kv head serves, at most 8 (the
    accumulator's columns); None: the shape's measured choice, else one where the blocks
    suffice (`attention.default_group`): fewer heads a block means more blocks attend, each K
    and V tile read by each of them. prefetch: each block also asks L2 for its product's
    weight tiles that many ahead of the one it puts in the ring (0: no), so that the stream
    goes on while the ring is full (measured slower at every shape: benchmarks/decode.md).
    tiles: the tile pieces a block's products make at a time, each in its own accumulator:
    their products run back to back on the tensor core and they pay one drain, one shared
    memory store and one LL store together, where 1 pays them for every tile (a block's
    products have 1-16 tiles at the presets' shapes). norm_sums: an RMSNorm's readers poll
    the D / 32 square sums of its vector (`plan.Layout`'s Xss, Hss: each written by lane 0
    of a warp of the vector's writers) instead of the D values: D / 32 of the words every
    reader of q|k|v's and gate|up's outputs polls, not D (a 1-2 KB poll, not 8-16 KB).
    packed: the products' pieces travel two values a word (`plan.pack`: each value's fp32
    rounded to 24 bits, 2^-16 relative, and a 16-bit tag), and a lane pair of their readers
    shares the words (`words.gather`): half the loads a lane and half the bytes a poll.
    Both are on by default: each step was faster with them at every preset measured
    (benchmarks/decode.md); False gives the kernel without them.

    w_head: [V, D] bf16 (V a multiple of 64), the output layer, read after the last layer
    (the final RMSNorm's gain folded into its columns, `xla.fold_head`): the result gains a
    last output (before trace's) z [sk, V] fp32 whose sum over sk is w_head bf16(x_L), the
    logits before the final norm's factor rsqrt(mean(x_L^2) + eps), which the caller applies
    (`gendist.inference.megakernel.step`). Its weight tiles stream into the ring right behind
    the last layer's, so the table's read overlaps the last handovers (`plan.head_product`:
    its split).

    inflight: the tensor-core products a block leaves running behind the one it has just
    issued before it frees a ring slot (1: the one before; a product of a 64 x 64 weight tile
    and an 8-row chunk is short and its latency, not its work, sets the pace of a block that
    has tiles waiting in its ring).

    loads: the weight tiles a block's producer keeps in flight at most (it waits for the
    tile `loads` before to land before it asks for the next); 0: as many as the ring has
    free slots; None: `plan.default_loads` (2 at d 1024, 6 at d 2048: measured in whole
    steps). A ring refilling after a handover otherwise puts up to 16 tiles a block (17 MB
    over 132 blocks, ~4 µs of the stream) in the memory system's queues at once, where the
    next handover's polls and first tiles wait behind them (benchmarks/decode.md).
    att_loads: the cap of the attention blocks, whose K and V tiles grow with the context
    (0: none); None: loads. att_splits: the attention blocks of each query group (1 to 8),
    each reading a split of the cached positions (`attention.split_tiles`) and writing its
    normalised output and log2-sum-exp, which o's readers merge (FlashDecoding's split-K):
    a context's K and V stream through that many rings, not one.

    state: the kernel's words kept from the call before (int32 [`state_size(...)`], zeros
    before the first; new_state=True makes them), so that no kernel before this one zeroes
    them: each call's words carry its epoch (`plan.tag`), which the last block out advances.
    Then the kernel also writes the new k and v into kv at row pos (in place, where kv's
    buffer can be given: a decode loop's cache) and the result is (x_L, kv with them,
    [z], [trace], state), kv in kv_new's place. A state serves one cache and one set of
    options (its size is theirs). embed: with a state, (table [V, D] bf16, token [1] int32)
    instead of x0_D (None): x_0 is the token's row (clamped to the table), which the kernel
    reads itself and writes as the host's words into the state (`plan.kept_layout`), so that
    no kernel before it builds them. advance: with a state, the kernel also adds one to pos
    (the cache length it decodes at) and the result ends in pos + 1, after the state.

    steps: greedy steps a call (1 to `resolve.MAX_STEPS`; more than 1 with state, embed,
    w_head, norm_eps and advance): step t decodes its token at pos + t and chooses the next
    as the argmax of its logits before the final norm's positive factor (`greedy`: the
    first among equal values), which the next step reads the row of, all in the one kernel:
    no kernel between steps, and the weight stream runs on from one step's output layer into
    the next step's first layer. The head is then split by whole rows (`plan.head_product`).
    The result is (y, kv, tokens [steps] int32, [trace], state, pos + steps): the last step's
    x_L, the cache with the steps' k and v, the chosen tokens, no logits."""
    if (x0_D is None) == (embed is None):
        raise ValueError("chain_mgpu: give x0_D or embed=(table, token), one of them.")
    if advance and state is None and not new_state:
        raise ValueError("chain_mgpu: advance=True moves pos on at the end of a call that keeps a state: "
                         "pass state=..., or advance pos outside.")
    if steps != 1 and not advance:
        raise ValueError(f"chain_mgpu: steps={steps} decodes at pos, pos + 1, ...: pass advance=True "
                         "(with state=...), so that the cache's length moves on with them.")
    sched = Schedule(stages=stages, tiles=tiles, inflight=inflight, loads=loads, prefetch=prefetch,
                     norm_sums=norm_sums, packed=packed, trace=trace, att_loads=att_loads,
                     att_splits=att_splits)
    c = resolve(x0_D, w_qkv, w_o, w_gu, w_down, kv, pos, rope, sched, blocks=blocks, norm_eps=norm_eps,
                splits=splits, spare=spare, group=group, w_head=w_head, kept=state is not None or new_state,
                embed=embed, steps=steps)
    size = c.state_words
    if new_state:
        state = jnp.zeros((size,), jnp.int32)
    elif state is not None and (state.shape != (size,) or state.dtype != jnp.int32):
        raise ValueError(f"chain_mgpu: state {state.shape} {state.dtype}: want int32 [{size}] for these shapes "
                         "and options (make one with new_state=True).")
    out = kernel_call(x0_D, w_qkv, w_o, w_gu, w_down, c, norm_eps, state, advance)
    out = list(out) if isinstance(out, tuple) else [out]
    if state is not None:  # (y, [z], [trace], kv, state[, pos]) -> (y, kv, [z], [trace], state[, pos])
        out.insert(1, out.pop(-2 - advance))
    if c.head is not None and steps == 1:
        z_at = 1 + (c.attn is not None)
        out[z_at] = out[z_at].reshape(c.head[1].split.sk, -1)
    return out[0] if len(out) == 1 else tuple(out)


def state_size(*inputs, **options) -> int:
    """The int32 words of `chain_mgpu(*inputs, **options, state=...)`'s state (inputs as
    arrays or shapes): the LL words of two layers' regions, the epoch and its count."""
    options = {k: v for k, v in options.items() if k not in ("advance", "steps")}
    return jax.eval_shape(lambda *a: chain_mgpu(*a, **options, new_state=True), *inputs)[-1].shape[0]
