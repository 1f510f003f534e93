"""Greedy decoding inside the decode megakernel (`chain_mgpu(steps=N)`): each step's token
is the argmax of the output layer's logits, chosen by the kernel's own blocks, so that the
next step starts without the kernel ending.

Three inline-PTX ops, one per stage of the choice:
- `track`: a head block, after each tile of its logits (64 rows, in shared memory), keeps
  each column's best value and its row in `best` (fp32 [2, 64]: values, rows as int32 bits);
- `publish`: then the block's best over its columns, the first row among equal values,
  goes out as two LL words (the value, the row), tagged with the step;
- `choose`: each block that writes x_0's chunks polls every head block's two words, takes
  the best (ties: the first row, as `jnp.argmax`), and leaves the token in shared memory
  (and block 0 writes it to the tokens' output), where `words.embed_words` reads it.

The logits are those before the final norm's positive factor (the fused head's, `kernel`):
their order is the logits'. Finite logits are assumed (a NaN row never wins; `jnp.argmax`
would take the first NaN). GPU only (inline PTX).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import SPIN_GUARD, gmem_address, lane, ptr32, ptr64, read_ref, warp_retry
from pallas_kernels.chain.plan import T

NEG_INF = "0fFF800000"


def _better(v: str, i: str, ov: str, oi: str) -> str:
    """PTX: (v, i) becomes (ov, oi) where ov > v, or ov == v and oi < i (the first row among
    equal values). Uses predicates q, w."""
    return (f" setp.gt.f32 q, {ov}, {v}; setp.eq.f32 w, {ov}, {v}; setp.lt.and.u32 w, {oi}, {i}, w;"
            f" or.pred q, q, w; @q mov.f32 {v}, {ov}; @q mov.u32 {i}, {oi};")


def _warp_best(v: str = "v", i: str = "i") -> str:
    """PTX: every lane of the warp ends with the warp's best (v, i) (butterfly shuffles)."""
    return "".join(f" shfl.sync.bfly.b32 ov, {v}, {m}, 31, -1; shfl.sync.bfly.b32 oi, {i}, {m}, 31, -1;"
                   + _better(v, i, "ov", "oi") for m in (16, 8, 4, 2, 1))


# lane % 32 == 0 stores its warp's (v, i) at red[8 warp], red[8 warp + 4] (bytes).
_PER_WARP = (" and.b32 t, $L, 31; setp.eq.u32 p, t, 0; shr.u32 t, $L, 5; shl.b32 t, t, 3; add.u32 t, t, $R;"
             " @p st.shared.f32 [t], v; @p st.shared.u32 [t+4], i;")


def _warps_best(red: str, warps: int) -> str:
    """PTX: (v, i) the best of `warps` warps' pairs at red (shared, `_PER_WARP`'s)."""
    ptx = f" ld.shared.f32 v, [{red}]; ld.shared.u32 i, [{red}+4];"
    for w in range(1, warps):
        ptx += f" ld.shared.f32 ov, [{red}+{8 * w}]; ld.shared.u32 oi, [{red}+{8 * w + 4}];" + _better("v", "i", "ov", "oi")
    return ptx


def track(tile_smem, best_smem, row0, first):
    """Columns c < 64 of one tile's logits (tile_smem fp32 [64], written before a
    `commit_smem()`): where first (traced, nonzero) or tile[c] > best's value c, best's
    column c becomes (tile[c], row0 + c). Lanes 0-63 each own a column; no branch, no
    barrier (each lane reads and writes only its own column)."""
    ptx = ("{ .reg .pred p, f; .reg .f32 v, b; .reg .u32 a, c, r;"
           " setp.lt.u32 p, $4, 64; and.b32 c, $4, 63; shl.b32 a, c, 2;"
           " add.u32 r, a, $0; ld.shared.f32 v, [r]; add.u32 r, a, $1; ld.shared.f32 b, [r];"
           " setp.ne.u32 f, $3, 0; setp.gt.or.f32 f, v, b, f; and.pred f, f, p;"
           f" @f st.shared.f32 [r], v; add.u32 c, c, $2; @f st.shared.u32 [r+{4 * T}], c; }}")
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=((plgpu.RefType(), plgpu.RefType()), [splat, splat]))
    def op(_, refs, vals):
        tile, best = refs
        r0, f = (v.registers[()] for v in vals)
        mgpu.utils.inline_ptx(ptx, ptr32(tile), ptr32(best), r0, f, lane(), has_side_effects=True)

    op((tile_smem, best_smem), [jnp.asarray(row0, jnp.int32), jnp.asarray(first, jnp.int32)])


def publish(best_smem, red_smem, ll_ref, word, tag):
    """The block's best over best_smem's 64 columns (`track`'s) as two LL words of ll_ref at
    `word` (traced): (the value's fp32 bits, tag) and (the row, tag). Ends in a warpgroup
    barrier. red_smem: at least 8 fp32 of scratch."""
    reduce_ptx = ("{ .reg .pred p, q, w; .reg .f32 v, ov; .reg .u32 i, oi, a, t;"
                  " and.b32 a, $L, 63; shl.b32 a, a, 2; add.u32 a, a, $B; ld.shared.f32 v, [a];"
                  f" ld.shared.u32 i, [a+{4 * T}]; setp.lt.u32 p, $L, 64;"
                  f" @!p mov.f32 v, {NEG_INF}; @!p mov.u32 i, -1;" + _warp_best() + _PER_WARP + " }")
    reduce_ptx = reduce_ptx.replace("$L", "$2").replace("$B", "$0").replace("$R", "$1")
    store_ptx = ("{ .reg .pred p, q, w; .reg .f32 v, ov; .reg .u32 i, oi; .reg .b32 x; .reg .b64 d;"
                 + _warps_best("$1", 2) + " setp.eq.u32 p, $2, 0; mov.b32 x, v; mov.b64 d, {x, $4};"
                 " @p st.relaxed.gpu.global.b64 [$3], d; mov.b64 d, {i, $4}; @p st.relaxed.gpu.global.b64 [$3+8], d; }")
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=((plgpu.RefType(),) * 3, [splat, splat]))
    def op(_, refs, vals):
        best, red, ll = refs
        w, t = (v.registers[()] for v in vals)
        mgpu.utils.inline_ptx(reduce_ptx, ptr32(best), ptr32(red), lane(), has_side_effects=True)
        mgpu.utils.warpgroup_barrier()
        mgpu.utils.inline_ptx(store_ptx, ptr32(best), ptr32(red), lane(), gmem_address(ptr64(ll), w, 8), t,
                              has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op((best_smem, red_smem, ll_ref), [jnp.asarray(word, jnp.int32), jnp.asarray(tag, jnp.int32)])


def choose(ll_ref, word, sources: int, tag, red_smem, token_smem, tokens_ref, index, write):
    """The token: the best of `sources` head blocks' word pairs (`publish`'s, from ll_ref's
    `word` on, traced), polled until every pair carries `tag` (all of a lane's pairs in one
    round trip; a warp polls until all its lanes see theirs, `warp_retry`). Every thread
    ends with it; thread 0 writes it to token_smem[0] (int32, shared) and, where `write`
    (traced, nonzero), to tokens_ref[index] (int32, global). Ends in a warpgroup barrier."""
    passes = -(-sources // 128)
    ptx = "{ .reg .pred p, q, w, r; .reg .f32 v, ov; .reg .u32 i, oi, n, t, j; .reg .b32 x, y; .reg .u64 g;"
    ptx += "".join(f" .reg .b64 d{k}, e{k}; .reg .u64 a{k};" for k in range(passes))
    for k in range(passes):  # pair min(lane + 128 k, sources - 1): every lane polls real words
        ptx += (f" add.u32 j, $L, {128 * k}; min.u32 j, j, {sources - 1}; mul.wide.u32 g, j, 16;"
                f" add.u64 a{k}, $A, g;")
    ptx += " mov.u32 n, 0; GRP:"
    ptx += "".join(f" ld.relaxed.gpu.global.b64 d{k}, [a{k}]; ld.relaxed.gpu.global.b64 e{k}, [a{k}+8];"
                   for k in range(passes))
    ptx += " setp.ne.u32 r, 0, 0;"
    for k in range(passes):
        ptx += (f" mov.b64 {{x, t}}, d{k}; setp.ne.or.u32 r, t, $G, r;"
                f" mov.b64 {{y, t}}, e{k}; setp.ne.or.u32 r, t, $G, r;")
    ptx += " " + SPIN_GUARD + " " + warp_retry("r", "GRP")
    for k in range(passes):
        ptx += f" mov.b64 {{x, t}}, d{k}; mov.b64 {{y, t}}, e{k};"
        ptx += " mov.b32 v, x; mov.u32 i, y;" if k == 0 else " mov.b32 ov, x; mov.u32 oi, y;" + _better("v", "i", "ov", "oi")
    ptx += _warp_best() + _PER_WARP + " }"
    ptx = ptx.replace("$L", "$2").replace("$A", "$0").replace("$G", "$1").replace("$R", "$3")
    out_ptx = ("{ .reg .pred p, q, w; .reg .f32 v, ov; .reg .u32 i, oi;" + _warps_best("$0", 4)
               + " setp.eq.u32 p, $1, 0; @p st.shared.u32 [$2], i; setp.ne.and.u32 p, $4, 0, p;"
               " @p st.global.u32 [$3], i; }")
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=((read_ref(),) + (plgpu.RefType(),) * 3, [splat] * 4))
    def op(_, refs, vals):
        ll, red, tok, toks = refs
        w, t, ix, wr = (v.registers[()] for v in vals)
        mgpu.utils.inline_ptx(ptx, gmem_address(ptr64(ll), w, 8), t, lane(), ptr32(red), has_side_effects=True)
        mgpu.utils.warpgroup_barrier()
        mgpu.utils.inline_ptx(out_ptx, ptr32(red), lane(), ptr32(tok), gmem_address(ptr64(toks), ix, 4), wr,
                              has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op((ll_ref, red_smem, token_smem, tokens_ref),
       [jnp.asarray(v, jnp.int32) for v in (word, tag, index, write)])


def publish_kv():
    """A fence after a block has written a new k and v into the cache with generic stores,
    which the block's producer reads with TMA (the async proxy) in a later step: the writes
    are ordered, for that proxy, before the block's later operations (its release of the
    barrier the producer waits on). GPU only (inline PTX)."""
    @plgpu.inline_mgpu()
    def op(_):
        mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    op()
