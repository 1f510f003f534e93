"""The attention phase of `chain_mgpu`'s decode megakernel: one block a group of query heads
sharing a kv head, batch 1, between the q|k|v product and the output product (Hopper, sm90).

With grouped-query attention (GQA, Ainslie et al. 2023, arXiv:2305.13245) query head i
reads kv head i // (query heads / kv heads). A block takes `group` of those query heads
(at most 8: one per column of the [64, 8] wgmma accumulator, i.e. one per row of the B
operand), so each K and V tile of its kv head is read once for all of them, or fewer, so
that more blocks share the attention's serial work (`default_group`: one where the blocks
suffice, measured faster). Multi-head attention is the group of 1. A block
(`head_of`: the last blocks, which the rectangle splits load least) takes query heads
h g .. h g + g - 1 of layer l (g = the group):

1. gathers their q, their kv head's k and v ((g + 2) hd values: the sums of q|k|v's
   pieces, times x_l's RMSNorm factor with norms) into fp32 shared memory (`words.gather`,
   out="f32");
2. `rope_new`: rotates the new k and each q (NeoX pairs (x[:hd/2], x[hd/2:]), fp32, rounded
   to bf16 as the cache holds them), writes q of head j into row j of the window the tensor
   core reads, the new k and v to the `kv_new` output [L, 2, H, hd] (the caller writes them
   into the cache at `pos` after the kernel, one update for every layer), and sums each
   q . k_new;
3. scores of the cached positions [0, pos): the K tiles [64 positions, 64] stream through
   the weight ring like any weight tile and wgmma takes them as A against the q rows (B),
   so that column j of the [64, 8] accumulator is head j's 64 scores;
4. `softmax`: each head's maximum over its scores and the new token's, then
   p = 2^((s - m) scale log2 e) as bf16 into row j of a second window (0 at positions >= pos);
5. P V: the V tiles, read transposed from the ring (A = V^T [64 dims, 64 positions])
   against the p rows (B); `combine` adds each head's new-token p v and divides by its sum;
6. the heads' outputs as LL words of the layer's "att" region (`words.ll_store_heads`):
   the output product's input.

With `att_splits` R > 1 (`split_tiles`) each query group has R blocks, each reading a split
of the position tiles (split-K over the keys, as FlashDecoding splits them: Dao et al. 2023,
"Flash-Decoding for long-context inference"): a split's maximum, p and P V are its own, only
the last split (which holds the new token's tile) adds the new token, and each writes its
output divided by its own sum, and its log2-sum-exp m scale log2 e + log2 l, to the "att"
and "lse" regions; o's readers weight the R outputs by 2^(lse - max lse) (`words.gather`).
A context's K and V then stream through R blocks' rings, not one.

The cache rows at and above pos are never trusted: their p is 0. The cache must hold finite
values there (0 * NaN is NaN on the tensor core too): the caller allocates it zeroed. The
new token's k and v are never read back from the cache (the row is written after the kernel).

Rounding follows `decode_attention.decode_attention_reference`: q and k rotated in fp32 and
cast to bf16, products accumulated in fp32; p is bf16 (here unnormalised, divided after).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import arith

from pallas_kernels._mgpu import const_i32, gmem_address, lane, ptr32, ptr64
from pallas_kernels.chain.words import X_TRANSFORMS, f32_hex

LOG2E = math.log2(math.e)
RED = 12  # fp32 words of the reduction scratch a query head: 4 warps' q.k_new, their max, their sum


def head_of(b, blocks: int):
    """The head block b attends to (b may be traced); it attends if that is below the head
    count: the last blocks take the heads, block blocks - 1 head 0."""
    return blocks - 1 - b


def tiles(pos):
    """Position tiles of 64 a head reads from the cache: those below pos, at least one (at
    pos 0 it is read and masked whole, so that every loop has a step)."""
    return jnp.maximum((pos + 63) // 64, 1)


def items(pos, head_dim: int, split=0, splits: int = 1):
    """Weight-ring steps of a head (or of its split `split` of `splits`, `split_tiles`): K
    tiles (tiles x hd/64 chunks) then V tiles."""
    t0, t1 = split_tiles(tiles(pos), split, splits)
    return 2 * (t1 - t0) * (head_dim // 64)


def split_tiles(n_tiles, split, splits: int):
    """The position tiles [t0, t1) of a head's n_tiles that attention block `split` of the
    head's `splits` reads (split-K over the positions, as FlashDecoding splits the keys:
    each split's softmax pieces are merged by the output product's readers). The last split
    always has at least one tile, the tile of the new token's position, and takes the new
    token itself (its "owner"); the others may have none. Works on ints and traced values."""
    if splits == 1:
        return 0, n_tiles
    return split * n_tiles // splits, (split + 1) * n_tiles // splits


def group_of(num_heads: int, kv_heads: int) -> int:
    """Query heads one block attends with: the largest divisor of the group size
    num_heads / kv_heads that is at most 8 (the columns of a [64, 8] wgmma accumulator: each
    query head is one column of B, so one K or V tile read serves them all)."""
    G = num_heads // kv_heads
    return max(g for g in range(1, min(G, 8) + 1) if G % g == 0)


def default_group(num_heads: int, kv_heads: int, blocks: int) -> int:
    """Query heads one block attends with where neither the caller nor `plan.MEASURED` says:
    the fewest dividing the group size (at most 8) that leave a block without attention, so
    one unless the query heads outnumber the blocks. A block's heads rotate, take their
    softmax and their output one after another, so spreading them over more blocks shortens
    the attention's critical path, while each K and V tile is then read by every block of its
    kv head (at about the same time). At Llama-3.2-1B's shape one head a block measured 0.781
    ms a step against 0.800 with two and 0.825 with four (benchmarks/decode.md)."""
    G = num_heads // kv_heads
    fits = [g for g in range(1, min(G, 8) + 1) if G % g == 0 and num_heads // g < blocks]
    return fits[0] if fits else group_of(num_heads, kv_heads)


def _win_offset(reg: str, idx: str, row: int = 0) -> str:
    """PTX: reg = byte offset of element idx of row `row` (< 8) of a 64-wide chunk in the bf16
    window: 8-row group idx / 64 (1 KB a group), row * 128 bytes, its 16-byte units swizzled
    (128-byte swizzle: unit ^= row; row 0 is linear)."""
    swz = f" xor.b32 wt, wt, {16 * row}; add.u32 {reg}, {reg}, {128 * row};" if row else ""
    return (f"shr.u32 {reg}, {idx}, 6; shl.b32 {reg}, {reg}, 10; and.b32 wt, {idx}, 63;"
            f" shl.b32 wt, wt, 1;{swz} add.u32 {reg}, {reg}, wt;")


_WARP_SUM = " ".join(f"shfl.sync.bfly.b32 r, x, {m}, 31, -1; add.f32 x, x, r;" for m in (16, 8, 4, 2, 1))
_WARP_MAX = " ".join(f"shfl.sync.bfly.b32 r, x, {m}, 31, -1; max.f32 x, x, r;" for m in (16, 8, 4, 2, 1))
# lane % 32 == 0 stores x at red[slot + warp] (slot: a word offset): operands named by the caller's PTX.
_PER_WARP = ("and.b32 w, {lane}, 31; setp.eq.u32 z, w, 0; shr.u32 w, {lane}, 5; add.u32 w, w, {slot};"
             " shl.b32 w, w, 2; add.u32 w, w, {red}; @z st.shared.f32 [w], x;")


def _rope_ptx(head_dim: int, group: int = 1) -> str:
    """Operands: $0 stage (fp32 q_0..q_{group-1} | k | v, shared), $1 window (shared), $2
    k_new's global address, $3 v_new's, $4 the angles (cos | sin, fp32 shared), $5 red
    (shared), $6 lane. The new k is rotated once; each query head g is rotated into row g
    of the window and its q . k_new summed into red's head-g partials."""
    h2 = head_dim // 2
    kq = 4 * group * head_dim  # k's byte offset in the stage
    ptx = (
        "{ .reg .pred p; .reg .pred z; .reg .f32 q1, q2, k1, k2, c, s, t, u, x, r; .reg .b16 a, b;"
        " .reg .u32 i, j, o, w, wt; .reg .u64 g;"
        f" setp.lt.u32 p, $6, {h2}; @!p bra ROPE_K;"
        " shl.b32 o, $6, 2; add.u32 i, $0, o;"
        f" ld.shared.f32 k1, [i+{kq}]; ld.shared.f32 k2, [i+{kq + 4 * h2}];"
        " add.u32 j, $4, o; ld.shared.f32 c, [j]; ld.shared.f32 s, [j+" + str(4 * h2) + "];"
        # the new k rotated, as bf16, to k_new
        " mul.f32 t, k2, s; neg.f32 t, t; fma.rn.f32 t, k1, c, t; cvt.rn.bf16.f32 a, t;"
        " mul.f32 u, k1, s; fma.rn.f32 u, k2, c, u; cvt.rn.bf16.f32 b, u;"
        " shl.b32 o, $6, 1; cvt.u64.u32 g, o; add.u64 g, g, $2; st.global.b16 [g], a;"
        f" st.global.b16 [g+{2 * h2}], b;"
        " cvt.f32.bf16 k1, a; cvt.f32.bf16 k2, b; ROPE_K:")
    for hq in range(group):  # query head hq: rotated to window row hq, times the new k
        per_warp = _PER_WARP.format(lane="$6", slot=12 * hq, red="$5")
        ptx += (
            f" mov.f32 x, 0f00000000; @!p bra ROPE_Q{hq};"
            f" ld.shared.f32 q1, [i+{4 * hq * head_dim}]; ld.shared.f32 q2, [i+{4 * (hq * head_dim + h2)}];"
            " mul.f32 t, q2, s; neg.f32 t, t; fma.rn.f32 t, q1, c, t; cvt.rn.bf16.f32 a, t;"
            " mul.f32 u, q1, s; fma.rn.f32 u, q2, c, u; cvt.rn.bf16.f32 b, u;"
            f" {_win_offset('j', '$6', hq)} add.u32 j, j, $1; st.shared.b16 [j], a;"
            f" add.u32 o, $6, {h2}; {_win_offset('j', 'o', hq)} add.u32 j, j, $1; st.shared.b16 [j], b;"
            " cvt.f32.bf16 q1, a; cvt.f32.bf16 q2, b;"
            " mul.f32 x, q1, k1; fma.rn.f32 x, q2, k2, x;"
            f" ROPE_Q{hq}: {_WARP_SUM} {per_warp}")
    vq = 4 * (group + 1) * head_dim  # v's byte offset in the stage
    return ptx + (
        # v: rounded to bf16, to v_new and back into the stage
        f" setp.lt.u32 p, $6, {head_dim}; @!p bra ROPE_E;"
        f" shl.b32 o, $6, 2; add.u32 i, $0, o; ld.shared.f32 t, [i+{vq}]; cvt.rn.bf16.f32 a, t;"
        " shl.b32 o, $6, 1; cvt.u64.u32 g, o; add.u64 g, g, $3; st.global.b16 [g], a;"
        f" cvt.f32.bf16 t, a; st.shared.f32 [i+{vq}], t; ROPE_E: }}")


def rope_new(stage_smem, win_smem, kv_new_ref, rope_smem, red_smem, k_word, v_word, head_dim: int,
             group: int = 1):
    """Step 2 of the module docstring for `group` query heads sharing one kv head. k_word /
    v_word: the element offsets of the kv head's new k and v in kv_new_ref (traced);
    rope_smem: the angles, cos | sin (fp32, in shared memory: loaded once a call, the same
    for every layer). Ends in a warpgroup barrier."""
    splat = plgpu.Layout.WG_SPLAT
    ptx = _rope_ptx(head_dim, group)

    ref_types = (plgpu.RefType(), plgpu.RefType(X_TRANSFORMS)) + (plgpu.RefType(),) * 3

    @plgpu.inline_mgpu(arg_types=(ref_types, [splat, splat]))
    def op(_, refs, words):
        stage, win, kvn, rope, red = refs
        base = ptr64(kvn)
        k_at, v_at = (gmem_address(base, w.registers[()], 2) for w in words)
        mgpu.utils.inline_ptx(ptx, ptr32(stage), ptr32(win), k_at, v_at, ptr32(rope),
                              ptr32(red), lane(), has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op((stage_smem, win_smem, kv_new_ref, rope_smem, red_smem),
       [jnp.asarray(k_word, jnp.int32), jnp.asarray(v_word, jnp.int32)])


def _max_ptx(group: int = 1, capacity: int = 0) -> str:
    """Operands: $0 scores (fp32 shared, [group, capacity]), $1 pos, $2 red, $3 lane."""
    ptx = "{ .reg .pred p; .reg .pred z; .reg .f32 x, r, y; .reg .u32 i, a, w;"
    for hq in range(group):
        per_warp = _PER_WARP.format(lane="$3", slot=12 * hq + 4, red="$2")
        ptx += (f" mov.f32 x, 0fFF800000; mov.u32 i, $3;"
                f" SMAX_L{hq}: setp.ge.u32 p, i, $1; @p bra SMAX_E{hq}; shl.b32 a, i, 2; add.u32 a, a, $0;"
                f" ld.shared.f32 y, [a+{4 * hq * capacity}]; max.f32 x, x, y; add.u32 i, i, 128; bra SMAX_L{hq};"
                f" SMAX_E{hq}: {_WARP_MAX} {per_warp}")
    return ptx + " }"


def _stats_ptx(red: str, hq: int = 0, owner: str | None = None) -> str:
    """PTX computing into s (q . k_new) and m (the maximum) of query head hq from the
    partials at operand red (head hq's 12 words: 4 warps' q . k_new, max, sum). owner (a
    predicate register; a split's blocks, `split_tiles`): the new token counts in m only
    where it is set (otherwise m starts at -inf)."""
    o = 48 * hq
    start = " mov.f32 m, s; " if owner is None else f" selp.f32 m, s, 0fFF800000, {owner}; "
    return (f"ld.shared.f32 s, [{red}+{o}]; " + " ".join(f"ld.shared.f32 y, [{red}+{o + 4 * w}]; add.f32 s, s, y;"
                                                        for w in (1, 2, 3))
            + start + " ".join(f"ld.shared.f32 y, [{red}+{o + 16 + 4 * w}]; max.f32 m, m, y;"
                               for w in range(4)))


def _p_ptx(scale_log2: float, group: int = 1, capacity: int = 0, split: bool = False) -> str:
    """Operands: $0 scores, $1 pos, $2 red, $3 lane, $4 the p window (shared), $5 positions
    to write (tiles * 64), (split) $6 nonzero where the block owns the new token. Head hq's
    p goes to row hq of the window's 8-row groups."""
    k = f32_hex(scale_log2)
    ptx = ("{ .reg .pred p; .reg .pred q; .reg .pred z;" + (" .reg .pred own;" if split else "")
           + " .reg .f32 x, r, y, s, m, e; .reg .b16 hb; .reg .u32 i, a, w, wt, j;"
           + (" setp.ne.u32 own, $6, 0;" if split else ""))
    for hq in range(group):
        per_warp = _PER_WARP.format(lane="$3", slot=12 * hq + 8, red="$2")
        ptx += (" " + _stats_ptx("$2", hq, "own" if split else None) + " mov.f32 x, 0f00000000; mov.u32 i, $3;"
                f" SP_L{hq}: setp.ge.u32 p, i, $5; @p bra SP_E{hq}; shl.b32 a, i, 2; add.u32 a, a, $0;"
                f" ld.shared.f32 y, [a+{4 * hq * capacity}]; sub.f32 y, y, m; mul.f32 y, y, {k};"
                " ex2.approx.f32 e, y;"
                " setp.lt.u32 q, i, $1; @!q mov.f32 e, 0f00000000; add.f32 x, x, e; cvt.rn.bf16.f32 hb, e;"
                f" {_win_offset('j', 'i', hq)} add.u32 j, j, $4; st.shared.b16 [j], hb;"
                f" add.u32 i, i, 128; bra SP_L{hq}; SP_E{hq}: {_WARP_SUM} {per_warp}")
    return ptx + " }"


def softmax(scores_smem, p_win, red_smem, pos, n_tiles, scale_log2: float, group: int = 1, owner=None):
    """Step 4 for `group` query heads (scores_smem [group, capacity / 64, 64]): the maxima
    (a warpgroup barrier), then each head's p into its row of p_win and the warps' sums of p
    into red (another barrier). pos, n_tiles traced: the block's own (a split's, `split_tiles`:
    its positions below pos, counted from its first tile). owner (traced; a split's blocks
    only): nonzero where the block owns the new token, whose score then counts in the
    maximum (elsewhere it does not, and a split without positions has maximum -inf)."""
    splat = plgpu.Layout.WG_SPLAT
    capacity = scores_smem.shape[1] * scores_smem.shape[2]
    split = owner is not None
    max_ptx, p_ptx = _max_ptx(group, capacity), _p_ptx(scale_log2, group, capacity, split)

    ref_types = (plgpu.RefType(), plgpu.RefType(X_TRANSFORMS), plgpu.RefType())
    traced = [jnp.asarray(pos, jnp.int32), jnp.asarray(n_tiles, jnp.int32)]
    traced += [jnp.asarray(owner, jnp.int32)] if split else []

    @plgpu.inline_mgpu(arg_types=(ref_types, [splat] * len(traced)))
    def op(_, refs, vals):
        sc, pw, red = refs
        pos_, n, *own = (v.registers[()] for v in vals)
        mgpu.utils.inline_ptx(max_ptx, ptr32(sc), pos_, ptr32(red), lane(), has_side_effects=True)
        mgpu.utils.warpgroup_barrier()
        mgpu.utils.inline_ptx(p_ptx, ptr32(sc), pos_, ptr32(red), lane(), ptr32(pw),
                              arith.muli(n, const_i32(64)), *own, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op((scores_smem, p_win, red_smem), traced)


def _combine_ptx(scale_log2: float, group: int = 1, split: bool = False) -> str:
    """Operands: $0 out (fp32 [group, 64] shared: each head's P V column, overwritten by its
    output), $1 the new v's 64 values (fp32 shared), $2 red, $3 lane; split: $4 lse (fp32
    [group, 64] shared: each head's log2-sum-exp, at every column), $5 nonzero where the
    block owns the new token, $6 nonzero where it has no positions (its out is then not
    read: 0)."""
    k = f32_hex(scale_log2)
    ptx = ("{ .reg .pred p;" + (" .reg .pred own; .reg .pred none; .reg .pred lp; .reg .u32 o3;" if split else "")
           + " .reg .f32 s, m, y, l, e, a, v; .reg .u32 o, o2;"
           " setp.ge.u32 p, $3, 64; @p bra CMB_E;"
           " shl.b32 o2, $3, 2; add.u32 o2, o2, $1; ld.shared.f32 v, [o2]; shl.b32 o, $3, 2; add.u32 o, o, $0;")
    if split:
        ptx += " setp.ne.u32 own, $5, 0; setp.ne.u32 none, $6, 0; shl.b32 o3, $3, 2; add.u32 o3, o3, $4;"
    for hq in range(group):
        r = 48 * hq
        ptx += (" " + _stats_ptx("$2", hq, "own" if split else None) +
                f" ld.shared.f32 l, [$2+{r + 32}]; ld.shared.f32 y, [$2+{r + 36}]; add.f32 l, l, y;"
                f" ld.shared.f32 y, [$2+{r + 40}]; add.f32 l, l, y; ld.shared.f32 y, [$2+{r + 44}]; add.f32 l, l, y;"
                f" sub.f32 y, s, m; mul.f32 y, y, {k}; ex2.approx.f32 e, y;"
                + (" @!own mov.f32 e, 0f00000000;" if split else "") + " add.f32 l, l, e;"
                f" ld.shared.f32 a, [o+{256 * hq}];")
        if split:  # a split without positions: out 0, l 1, lse -inf (m is)
            ptx += (" @none mov.f32 a, 0f00000000; setp.gt.f32 lp, l, 0f00000000;"
                    " @!lp mov.f32 l, 0f3F800000;")
        ptx += f" fma.rn.f32 a, e, v, a; div.approx.f32 a, a, l; st.shared.f32 [o+{256 * hq}], a;"
        if split:  # log2 of the sum of 2^((score - m) k), plus m k
            ptx += f" lg2.approx.f32 y, l; fma.rn.f32 y, m, {k}, y; st.shared.f32 [o3+{256 * hq}], y;"
    return ptx + " CMB_E: }"


def combine(out_smem, stage_smem, red_smem, v_offset, scale_log2: float, group: int = 1,
            lse_smem=None, owner=None, empty=None):
    """Step 5's end for `group` heads: out_smem[g, i] = (out_smem[g, i] + p_new v_new[v_offset + i])
    / l_g for i < 64, v_new the stage's fp32 words from v_offset (traced or static). A
    split's block (`split_tiles`; lse_smem, owner and empty given, traced): p_new only where
    it owns the new token, out 0 where it has no positions, and lse_smem[g, i] its
    log2-sum-exp (m_g scale log2 e + log2 l_g; -inf without positions), what o's readers
    weight the splits' outputs by. Ends in a barrier."""
    splat = plgpu.Layout.WG_SPLAT
    split = lse_smem is not None
    ptx = _combine_ptx(scale_log2, group, split)
    refs = (out_smem, stage_smem, red_smem) + ((lse_smem,) if split else ())
    traced = [jnp.asarray(v_offset, jnp.int32)]
    traced += [jnp.asarray(owner, jnp.int32), jnp.asarray(empty, jnp.int32)] if split else []

    @plgpu.inline_mgpu(arg_types=((plgpu.RefType(),) * len(refs), [splat] * len(traced)))
    def op(_, refs, vals):
        out, stage, red, *lse = refs
        v_off, *flags = (x.registers[()] for x in vals)
        v = arith.addi(ptr32(stage), arith.muli(v_off, const_i32(4)))
        extra = [ptr32(lse[0]), *flags] if split else []
        mgpu.utils.inline_ptx(ptx, ptr32(out), v, ptr32(red), lane(), *extra, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(refs, traced)
