"""A batch-1 decode layer's weight products, every layer, as ONE persistent Mosaic GPU kernel
whose phases hand activations over as low-latency words: a decode megakernel's skeleton
(Hopper, sm90; issue 19).

Per layer l, from the residual stream x_l [D] (fp32):
    a   = Wqkv_l n_l(x_l)                 [N1]
    h_l = x_l + Wo_l a[:D]                 (attention's place: the q part goes straight on)
    g   = Wgu_l m_l(h_l)                   [2F]
    x_{l+1} = h_l + Wd_l (silu(g[:F]) * g[F:])
with every product's input rounded to bf16 (as the decode path's products read it) and fp32
sums; n_l, m_l are RMSNorms (`norm_eps`; their gains folded into Wqkv's and Wgu's columns,
`fold_norms`, and the factor rsqrt(mean(v^2) + eps) applied by the readers of the product's
output, each block summing the squares of the dense residual itself) or the identity. No
attention yet: this kernel measures what a megakernel's weight stream and phase boundaries
cost, the part of a decode step that is most of its bytes.

Why (benchmarks/README.md, issue 19): a decode step at batch 1 is ~230 kernels that each pay
a fixed ramp and tail; one persistent kernel pays it once, but then needs a grid-wide
handover between dependent products. On the H200 a fenced barrier (TMA store, proxy and
release fences, counter) costs ~1.9 us of stream time per handover, while a handover as
NCCL's LL protocol does it (`_mgpu.ll_store` / `ll_gather`: each value travels with its tag
in one relaxed 64-bit store, readers poll the values themselves, no fence) costs 0.2-1.0 us
for 1-8 sources (`experiments/probe_tma_stream.py`, mode ll).

Work: each product's [N/64 row tiles, K/64 chunks] items are split into sk x st rectangles
(`choose_split`): block b takes chunk group b // st and tile group b % st, so it reads only
its chunks' inputs and writes one partial ("piece") of each of its tiles; a tile's value is
the sum of its sk pieces. The next product's readers poll those pieces (and the residual,
materialised once as dense words by the readers of tile group 0) for their chunks, sum them,
apply SwiGLU where it belongs, and write row 0 of each chunk's 8-row tile of a bf16 window;
wgmma takes the weight tile [64, 64] as A and that chunk tile seen transposed as B [64, 8]
(rows 1-7 reach only accumulator columns that are never read). A producer warpgroup streams
the weight tiles through a `stages`-slot TMA ring without waiting for any activation: the
weights run ahead across phases and layers. Every LL word is written once a call (the words
live in a global semaphore array, zeroed before the kernel); tag 1 marks a written word.
Every poll traps after `_mgpu.SPIN_LIMIT` tries: a word never written is a CUDA error, not
a hung GPU. (The zeroing is a memset of the whole array each call: ~44 MB at 1b, a few µs;
tags that count calls would remove it.)

GPU only (the words are moved by inline PTX, which Mosaic GPU's interpreter does not run);
`reference` is the same math in XLA, `schedule` the decomposition (CPU-testable).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_kernels._mgpu import (
    SMEM_LIMIT,
    SPIN_GUARD,
    WGMMA,
    launch,
    sm_count,
    smem_bytes,
    tiled_smem,
)

T = 64  # rows of a weight tile (wgmma N) and of an activation chunk
KC = 64  # columns of a weight tile (one chunk of K)
_ITEM_US = 0.26  # one 8 KB tile per SM at ~4.1 TB/s over 132 SMs


def poll_us(sources: int) -> float:
    """A handover's cost in stream time when each reader waits for `sources` writers' words,
    fitted to the H200's (probe_tma_stream mode ll: 0.23 / 0.48 / 0.59 / 1.00 / 1.34 / 1.64 /
    2.09 us for 1 / 2 / 3 / 8 / 16 / 32 / 64 sources): about 0.2 + 0.3 log2(sources)."""
    return 0.2 + 0.3 * math.log2(max(sources, 1))


@dataclasses.dataclass(frozen=True)
class Split:
    """A product's [tiles, chunks] items in sk chunk groups x st tile groups (sk * st blocks)."""

    sk: int
    st: int


@dataclasses.dataclass(frozen=True)
class Product:
    name: str
    N: int  # output rows
    K: int  # input width
    split: Split

    @property
    def tiles(self) -> int:
        return self.N // T

    @property
    def chunks(self) -> int:
        return self.K // KC

    def kmax(self) -> int:
        """The most chunks a block reads."""
        return -(-self.chunks // self.split.sk)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_split(tiles: int, chunks: int, blocks: int, sources_in: int = 1, fan_out: int = 1) -> Split:
    """The rectangle split with the least estimated time: the busiest block's items at the
    stream's per-SM rate, its polling passes (two chunks a pass; the first waits, the others
    find their words written) over `sources_in` sources each, and the handover its own
    pieces cost the next product's readers (sk * fan_out sources)."""
    best = None
    for sk in range(1, chunks + 1):
        for st in range(1, min(tiles, blocks // sk) + 1):
            items = -(-tiles // st) * -(-chunks // sk)
            passes = -(-cdiv(chunks, sk) // 2)
            cost = (items * _ITEM_US + poll_us(sources_in) + (passes - 1) * 0.2
                    + poll_us(sk * fan_out))
            if best is None or cost < best[0]:
                best = (cost, Split(sk, st))
    return best[1]


def products(D: int, N1: int, F: int, blocks: int) -> tuple[Product, ...]:
    """The layer's four products with their splits (qkv, o, gate|up, down)."""
    out, sources = [], 2  # the first reads the previous down's pieces and a residual
    # fan_out: sources a reader of this product's pieces polls per piece set (gate and up;
    # a residual beside qkv's and o's readers... counted as 1 extra by sources_in below).
    for name, N, K, fan in (("qkv", N1, D, 1), ("o", D, D, 1), ("gu", 2 * F, D, 2), ("down", D, F, 1)):
        split = choose_split(N // T, K // KC, blocks, sources, fan)
        out.append(Product(name, N, K, split))
        sources = split.sk * fan + (name in ("o", "down"))
    return tuple(out)


def predict_us_per_layer(D: int, N1: int, F: int, blocks: int) -> float:
    """The cost model's µs a layer: for each product its busiest block's tiles at the
    stream's per-SM rate, then its readers' poll (the sources each waits for), serially."""
    prods = products(D, N1, F, blocks)
    qkv, o, gu, down = prods
    sources = {"qkv": down.split.sk + 1, "o": qkv.split.sk, "gu": o.split.sk + 1, "down": 2 * gu.split.sk}
    total = 0.0
    for p in prods:
        rects = [rect(p, b) for b in range(blocks)]
        busiest = max((t1 - t0) * (k1 - k0) for active, t0, t1, k0, k1 in rects if active)
        total += busiest * _ITEM_US + poll_us(sources[p.name]) + (cdiv(p.kmax(), 2) - 1) * 0.2
    return total


def rect(p: Product, b):
    """Block b's rectangle of product p: (active, t0, t1, k0, k1); works on ints and traced."""
    gk, gt = b // p.split.st, b % p.split.st
    active = b < p.split.sk * p.split.st
    k0, k1 = gk * p.chunks // p.split.sk, (gk + 1) * p.chunks // p.split.sk
    t0, t1 = gt * p.tiles // p.split.st, (gt + 1) * p.tiles // p.split.st
    return active, t0, t1, k0, k1


def schedule(D: int, N1: int, F: int, blocks: int):
    """{product name: [(block, t0, t1, k0, k1) for active blocks]}: the decomposition."""
    return {p.name: [(b, *rect(p, b)[1:]) for b in range(blocks) if rect(p, b)[0]]
            for p in products(D, N1, F, blocks)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Word offsets (8-byte LL words) of each layer's regions in the semaphore array: every
    product's pieces [tiles, sk, 64], and the dense residuals X_l (qkv's input, l >= 1) and
    H_l (gate|up's input). `init` is the layout of the host-written words standing in for
    layer -1: the down pieces (zeros) and H_{-1} = x_0."""

    offsets: dict
    layer_words: int
    init_down: int
    init_H: int
    init_words: int


def layout(prods, D: int) -> Layout:
    offsets, w = {}, 0
    for p in prods:
        offsets[p.name] = w
        w += p.tiles * p.split.sk * T
    for name in ("X", "H"):
        offsets[name] = w
        w += D
    down = prods[3]
    init_H = down.tiles * down.split.sk * T
    return Layout(offsets, w, 0, init_H, init_H + D)


def init_words(x0_D, prods, lay: Layout):
    """The host-written words for layer -1, as int32 pairs [init_words, 2]: zero down pieces
    and x_0, each tagged 1."""
    vals = jnp.concatenate([jnp.zeros((lay.init_H,), jnp.float32), x0_D.astype(jnp.float32)])
    bits = lax.bitcast_convert_type(vals, jnp.int32)
    return jnp.stack([bits, jnp.ones_like(bits)], axis=-1).reshape(-1)


def _i32(v: int):
    return mgpu.utils.c(v, ir.IntegerType.get_signless(32))


def _f32_hex(v: float) -> str:
    """A PTX fp32 immediate."""
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def _gather_ptx(n_a: int, n_b: int, dense: bool, out: str, norm: tuple[float, int] | None = None) -> str:
    """One lane's poll: operands $0.. the n_a + n_b source addresses, then (dense) the dense
    word's address and its write flag, then the shared-memory address. Sums group A (and B),
    writes A's sum as a dense word if asked, and stores bf16(A) or bf16(silu(A) * B)
    (out="bf16") or A as fp32 (out="f32"). norm=(eps, D): the operand before the last is the
    shared-memory address of 4 warp partial sums of squares of a D-vector (`_norm_ptx`); A
    and B are scaled by rsqrt(sum / D + eps) first (the RMSNorm whose gain is folded into
    the weights)."""
    n = n_a + n_b
    regs = " ".join(f".reg .b64 d{k}; .reg .b32 v{k}; .reg .b32 t{k};" for k in range(n))
    loads = " ".join(f"ld.relaxed.gpu.global.b64 d{k}, [${k}]; mov.b64 {{v{k}, t{k}}}, d{k};"
                     for k in range(n))
    checks = " ".join(f"setp.ne.b32 p, t{k}, 1; @p bra LAB_G;" for k in range(n))
    sum_a = " ".join(f"mov.b32 g, v{k}; add.f32 fa, fa, g;" for k in range(n_a))
    sum_b = " ".join(f"mov.b32 g, v{k}; add.f32 fb, fb, g;" for k in range(n_a, n))
    body = f"mov.f32 fa, 0f00000000; mov.f32 fb, 0f00000000; {sum_a} {sum_b}"
    i = n
    if dense:
        body += (f" setp.ne.u32 q, ${i + 1}, 0; mov.b32 w, fa; mov.b32 one, 1;"
                 f" mov.b64 dd, {{w, one}}; @q st.relaxed.gpu.global.b64 [${i}], dd;")
        i += 2
    if norm:
        eps, width = norm
        body += (f" ld.shared.f32 e, [${i}]; ld.shared.f32 g, [${i}+4]; add.f32 e, e, g;"
                 f" ld.shared.f32 g, [${i}+8]; add.f32 e, e, g; ld.shared.f32 g, [${i}+12]; add.f32 e, e, g;"
                 f" mul.f32 e, e, {_f32_hex(1.0 / width)}; add.f32 e, e, {_f32_hex(eps)};"
                 " rsqrt.approx.f32 e, e; mul.f32 fa, fa, e; mul.f32 fb, fb, e;")
        i += 1
    if n_b:  # silu(a) * b = a / (1 + 2^(-a log2 e)) * b
        body += (" mul.f32 e, fa, 0fBFB8AA3B; ex2.approx.f32 e, e; add.f32 e, e, 0f3F800000;"
                 " div.approx.f32 fa, fa, e; mul.f32 fa, fa, fb;")
    if out == "bf16":
        body += f" cvt.rn.bf16.f32 h, fa; st.shared.b16 [${i}], h;"
    else:
        body += f" st.shared.f32 [${i}], fa;"
    return (f"{{ .reg .pred p; .reg .pred q; .reg .u32 n; .reg .f32 fa; .reg .f32 fb; .reg .f32 g;"
            f" .reg .f32 e; .reg .b32 w; .reg .b32 one; .reg .b64 dd; .reg .b16 h; {regs}"
            f" mov.u32 n, 0; LAB_G: {loads} {SPIN_GUARD} {checks} {body} }}")


def _gather_call(ll_ref, init_ref, dst_ref, groups, *, out: str, c0, c1, k0, use_init,
                 dense_base=None, dense_on=None, norm_ref=None, norm=None):
    """The inline op behind a product's input: lanes < 64 read column lane of chunk c0, the
    others column lane - 64 of chunk c1. groups: [(count, stride, is_b, base_word, init_ok)]
    with count/stride/is_b static (stride: words from one chunk to the next, 64 * sk for
    pieces, 64 for a dense vector) and base_word traced; init_ok: this group reads the host's
    words instead of the kernel's when use_init (layer 0). Writes row 0 of the chunk's 8-row
    group (chunk - k0) of the bf16 window dst_ref (tiled, swizzled: that row is linear), or
    dst_ref[col] in fp32 (out="f32"); with dense_base, A's sum as a dense word at
    dense_base + chunk * 64 + col when dense_on != 0; with norm=(eps, D), the sums scaled by
    the RMSNorm factor from norm_ref's partials (`_norm_partials`). Ends in a warpgroup barrier."""
    n_a = sum(g[0] for g in groups if not g[2])
    n_b = sum(g[0] for g in groups if g[2])
    dense = dense_base is not None
    ptx = _gather_ptx(n_a, n_b, dense, out, norm)
    # A's groups first, then B's, in the order the PTX sums them.
    ordered = [g for g in groups if not g[2]] + [g for g in groups if g[2]]
    splat = plgpu.Layout.WG_SPLAT
    traced = [jnp.asarray(v, jnp.int32) for v in (c0, c1, k0, use_init)]
    traced += [jnp.asarray(g[3], jnp.int32) for g in ordered]
    if dense:
        traced += [jnp.asarray(dense_base, jnp.int32), jnp.asarray(dense_on, jnp.int32)]

    dst_type = plgpu.RefType(_X_TRANSFORMS) if out == "bf16" else plgpu.RefType()
    refs = (ll_ref, init_ref, dst_ref) + ((norm_ref,) if norm else ())
    ref_types = (plgpu.RefType(), plgpu.RefType(), dst_type) + ((plgpu.RefType(),) if norm else ())

    @plgpu.inline_mgpu(arg_types=(ref_types, [splat] * len(traced)))
    def op(_, rs, vals):
        ll, init, dst = rs[:3]
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        v = [x.registers[()] for x in vals]
        c0_, c1_, k0_, init_flag = v[:4]
        bases = v[4:4 + len(ordered)]
        lane = arith.remui(mgpu.utils.thread_idx(), _i32(128))
        col = arith.remui(lane, _i32(64))
        hi = arith.cmpi(arith.CmpIPredicate.uge, lane, _i32(64))
        chunk = arith.select(hi, c1_, c0_)
        ll_p = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ll))
        init_p = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(init))
        from_init = arith.cmpi(arith.CmpIPredicate.ne, init_flag, _i32(0))

        def addr(ptr, word):
            return arith.addi(ptr, arith.muli(arith.extui(i64, word), mgpu.utils.c(8, i64)))

        addrs = []
        for (count, stride, _, _, init_ok), base in zip(ordered, bases, strict=True):
            first = arith.addi(arith.addi(base, arith.muli(chunk, _i32(stride))), col)
            ptr = arith.select(from_init, init_p, ll_p) if init_ok else ll_p
            addrs += [addr(ptr, arith.addi(first, _i32(64 * j))) for j in range(count)]
        operands = addrs
        if dense:
            dbase, don = v[4 + len(ordered):]
            operands += [addr(ll_p, arith.addi(arith.addi(dbase, arith.muli(chunk, _i32(64))), col)), don]
        if norm:
            operands.append(llvm.ptrtoint(i32, mgpu.utils.memref_ptr(rs[3])))
        dst_p = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(dst))
        if out == "bf16":  # row 0 of 8-row group (chunk - k0): 1 KB a group, linear in the row
            off = arith.addi(arith.muli(arith.subi(chunk, k0_), _i32(1024)), arith.muli(col, _i32(2)))
        else:
            off = arith.muli(col, _i32(4))
        operands.append(arith.addi(dst_p, off))
        mgpu.utils.inline_ptx(ptx, *operands, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(refs, traced)


def _norm_ptx(per_lane: int) -> str:
    """Operands: $0 the address of dense word `lane` of a vector (words lane + 128 i,
    i < per_lane), $1 the lane, $2 the 4-float shared scratch. Polls the words, sums their
    squares, reduces the warp by butterfly shuffles, and lane 0 of each warp stores its sum."""
    regs = " ".join(f".reg .b64 d{k}; .reg .b32 v{k}; .reg .b32 t{k}; .reg .u64 a{k};" for k in range(per_lane))
    addrs = "mul.wide.u32 a0, $1, 8; add.u64 a0, a0, $0; " + " ".join(
        f"add.u64 a{k}, a{k - 1}, 1024;" for k in range(1, per_lane))
    loads = " ".join(f"ld.relaxed.gpu.global.b64 d{k}, [a{k}]; mov.b64 {{v{k}, t{k}}}, d{k};" for k in range(per_lane))
    checks = " ".join(f"setp.ne.b32 p, t{k}, 1; @p bra LAB_N;" for k in range(per_lane))
    squares = " ".join(f"mov.b32 x, v{k}; fma.rn.f32 s, x, x, s;" for k in range(per_lane))
    shuffle = " ".join(f"mov.b32 r, s; shfl.sync.bfly.b32 r, r, {m}, 31, -1; mov.b32 x, r; add.f32 s, s, x;"
                       for m in (16, 8, 4, 2, 1))
    return (f"{{ .reg .pred p; .reg .u32 n; .reg .f32 s; .reg .f32 x; .reg .b32 r; .reg .u32 w; {regs}"
            f" {addrs} mov.u32 n, 0; LAB_N: {loads} {SPIN_GUARD} {checks} mov.f32 s, 0f00000000;"
            f" {squares} {shuffle} and.b32 w, $1, 31; setp.ne.u32 p, w, 0; shr.u32 w, $1, 5;"
            f" shl.b32 w, w, 2; add.u32 w, w, $2; @!p st.shared.f32 [w], s; }}")


def _norm_partials(ll_ref, init_ref, scratch_ref, base_word, from_init, init_ok: bool, width: int):
    """The 4 warp partial sums of squares of the dense D-vector at LL word base_word (the
    host's words when init_ok and from_init), into scratch_ref; then a warpgroup barrier."""
    if width % 128:
        raise ValueError(f"chain_mgpu norms: D={width} must be a multiple of 128.")
    ptx = _norm_ptx(width // 128)
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), splat, splat))
    def op(_, ll, init, scratch, base, flag):
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        lane = arith.remui(mgpu.utils.thread_idx(), _i32(128))
        ll_p = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ll))
        ptr = ll_p
        if init_ok:
            from_init_ = arith.cmpi(arith.CmpIPredicate.ne, flag.registers[()], _i32(0))
            ptr = arith.select(from_init_, llvm.ptrtoint(i64, mgpu.utils.memref_ptr(init)), ll_p)
        start = arith.addi(ptr, arith.muli(arith.extui(i64, base.registers[()]), mgpu.utils.c(8, i64)))
        sc = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(scratch))
        mgpu.utils.inline_ptx(ptx, start, lane, sc, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(ll_ref, init_ref, scratch_ref, jnp.asarray(base_word, jnp.int32), jnp.asarray(from_init, jnp.int32))


_STORE_PTX = ("{ .reg .b32 v; .reg .b32 one; .reg .b64 d; ld.shared.b32 v, [$0];"
              " mov.b32 one, 1; mov.b64 d, {v, one}; st.relaxed.gpu.global.b64 [$1], d; }")


def _store_piece(ll_ref, src_ref, word):
    """Lanes < 64 write src_ref[lane] (fp32, row 0 of the accumulator's staging tile) as LL
    word `word + lane`; then a warpgroup barrier (the staging tile is reused)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def op(_, ll, src, w):
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        lane = arith.remui(mgpu.utils.thread_idx(), _i32(128))
        lo = arith.cmpi(arith.CmpIPredicate.ult, lane, _i32(64))
        col = arith.remui(lane, _i32(64))
        src_a = arith.addi(llvm.ptrtoint(i32, mgpu.utils.memref_ptr(src)), arith.muli(col, _i32(4)))
        word_ = arith.extui(i64, arith.addi(w.registers[()], col))
        dst_a = arith.addi(llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ll)),
                           arith.muli(word_, mgpu.utils.c(8, i64)))
        pred = lo
        ptx = _STORE_PTX.replace("ld.shared", "@$2 ld.shared").replace("st.relaxed", "@$2 st.relaxed")
        mgpu.utils.inline_ptx(ptx, src_a, dst_a, pred, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(ll_ref, src_ref, jnp.asarray(word, jnp.int32))


def piece_word(p: Product, l, t, gk, lay: Layout):
    """First LL word of layer l's piece of tile t of product p from chunk group gk."""
    return l * lay.layer_words + lay.offsets[p.name] + (t * p.split.sk + gk) * T


def input_spec(name: str, l, gt, prods, lay: Layout, F: int, norms: bool = False):
    """Where product `name` of layer l reads its input chunk c (block in tile group gt):
    (groups, dense). groups: [(count, stride, is_b, base_word, init_ok)], the words
    base_word + c * stride + j * 64 + col for j < count (group B, is_b, is SwiGLU's up);
    init_ok: at layer 0 these words are the host's (`init_words`). dense: where the readers
    of tile group 0 write the input's sum (A's) as a dense vector, {} for none. norm (with
    norms): (base_word, init_ok) of the dense vector whose RMSNorm factor scales this input
    (x_l for the q|k|v output that o reads, h_l for gate|up's), else None. Works on ints
    (tests) and traced values (the kernel)."""
    qkv, o, gu, down = prods

    def base(layer, region):
        return layer * lay.layer_words + lay.offsets[region]

    first = l == 0
    if name == "qkv":  # x_l = H_{l-1} + the previous down's pieces; X_l dense
        groups = [(down.split.sk, 64 * down.split.sk, False,
                   jnp.where(first, lay.init_down, base(l - 1, "down")), True),
                  (1, 64, False, jnp.where(first, lay.init_H, base(l - 1, "H")), True)]
        return groups, dict(dense_base=base(l, "X"), dense_on=(gt == 0) & (l > 0)), None
    if name == "o":  # the q part of qkv's pieces (times x_l's RMSNorm factor)
        norm = (jnp.where(first, lay.init_H, base(l, "X")), True) if norms else None
        return [(qkv.split.sk, 64 * qkv.split.sk, False, base(l, "qkv"), False)], {}, norm
    if name == "gu":  # h_l = X_l + o's pieces; H_l dense
        groups = [(o.split.sk, 64 * o.split.sk, False, base(l, "o"), False),
                  (1, 64, False, jnp.where(first, lay.init_H, base(l, "X")), True)]
        return groups, dict(dense_base=base(l, "H"), dense_on=gt == 0), None
    if name == "down":  # silu(gate) * up from gate|up's pieces (times h_l's RMSNorm factor)
        g0, stride = base(l, "gu"), 64 * gu.split.sk
        norm = (base(l, "H"), False) if norms else None
        return [(gu.split.sk, stride, False, g0, False),
                (gu.split.sk, stride, True, g0 + (F // T) * stride, False)], {}, norm
    if name == "final":  # x_L = H_{L-1} + the last down's pieces (l = L - 1)
        return [(down.split.sk, 64 * down.split.sk, False, base(l, "down"), False),
                (1, 64, False, base(l, "H"), False)], {}, None
    raise ValueError(f"input_spec: no product {name!r}")


_X_TRANSFORMS = (plgpu.TilingTransform((8, KC)), plgpu.SwizzleTransform(2 * KC))


def _window_rows(kmax: int) -> int:
    """Rows of the bf16 input window: chunk i is the 8-row tile at row 8 i (its row 0 the
    values, rows 1-7 whatever they hold: they reach only accumulator columns never read)."""
    return 8 * kmax


def _kernel_call(x0_D, w_qkv, w_o, w_gu, w_down, prods, stages: int, blocks: int,
                 norm_eps: float | None):
    L, D = w_o.shape[0], w_o.shape[1]
    F = w_down.shape[2]
    lay = layout(prods, D)
    init = init_words(x0_D, prods, lay)
    NB, st = blocks, stages
    kmax = max(p.kmax() for p in prods)
    qkv, o, gu, down = prods

    def counts(b):  # items a layer, and before each product, for block b (traced)
        n, before = 0, []
        for p in prods:
            active, t0, t1, k0, k1 = rect(p, b)
            before.append(n)
            n = n + jnp.where(active, (t1 - t0) * (k1 - k0), 0)
        return n, before

    def kernel(init_ref, wq_ref, wo_ref, wgu_ref, wd_ref, y_ref, x_win, w_smem, acc_smem, out_smem,
               norm_smem, full, free):
        b, wg = lax.axis_index("b"), lax.axis_index("wg")
        ll = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * L * lay.layer_words,)))
        w_refs = (wq_ref, wo_ref, wgu_ref, wd_ref)
        per_layer, before = counts(b)

        def base(l, name):  # first word of layer l's region (l may be traced)
            return l * lay.layer_words + lay.offsets[name]

        def produce(l, i, p):  # layer l's product p: its weight tiles into the ring
            active, t0, t1, k0, k1 = rect(p, b)
            nk = k1 - k0
            j0 = l * per_layer + before[i]

            @pl.when(active)
            def _():
                @pl.loop(0, (t1 - t0) * nk)
                def _(q):
                    j = j0 + q
                    t, k = t0 + q // nk, k0 + lax.rem(q, nk)
                    slot = lax.rem(j, st)
                    pl.when(j >= st)(lambda: plgpu.barrier_wait(free.at[slot]))
                    plgpu.copy_gmem_to_smem(w_refs[i].at[l, pl.ds(t * T, T), pl.ds(k * KC, KC)],
                                            w_smem.at[slot], full.at[slot])

        def gather(l, p, k0, k1, gt):
            """The window's rows for chunks k0..k1-1 of product p's input, two chunks a pass."""
            first = l == 0
            groups, dense, norm = input_spec(p.name, l, gt, prods, lay, F, norm_eps is not None)
            if norm is not None:
                _norm_partials(ll, init_ref, norm_smem, norm[0], first, norm[1], D)
                dense = dict(dense, norm_ref=norm_smem, norm=(norm_eps, D))
            for ps in range(cdiv(p.kmax(), 2)):
                c0 = k0 + 2 * ps
                c1 = jnp.minimum(c0 + 1, k1 - 1)
                pl.when(c0 < k1)(functools.partial(
                    _gather_call, ll, init_ref, x_win, groups, out="bf16", c0=c0, c1=c1, k0=k0,
                    use_init=first, **dense))
            plgpu.commit_smem()  # the window's rows, for the tensor core

        def tile_piece(l, p, t, jt, nk, gk):
            """Tile t's sum over this block's nk chunks (ring steps jt..), as LL words."""
            def k_loop(acc):
                @pl.loop(0, nk)
                def _(kk):
                    j = jt + kk
                    slot = lax.rem(j, st)
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.wgmma(acc, w_smem.at[slot], x_win.at[pl.ds(8 * kk, 8)].transpose((1, 0)))
                    plgpu.wgmma_wait(1)  # step j - 1's product is done: its slot is free
                    pl.when(kk > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(j + st - 1, st)]))

                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free.at[lax.rem(jt + nk - 1, st)])
                return acc[...]

            acc = pl.run_scoped(k_loop, plgpu.ACC((T, 8), jnp.float32))
            first_col = plgpu.broadcasted_iota(jnp.int32, (T, 8), 1, layout=WGMMA) == 0
            acc_smem[...] = jnp.where(first_col, acc, 0.0).sum(axis=1)
            plgpu.commit_smem()
            _store_piece(ll, acc_smem, piece_word(p, l, t, gk, lay))

        def consume(l, i, p):  # layer l's product p: its input, then its tiles' pieces
            active, t0, t1, k0, k1 = rect(p, b)
            nk = k1 - k0
            j0 = l * per_layer + before[i]

            @pl.when(active)
            def _():
                gather(l, p, k0, k1, b % p.split.st)
                pl.loop(t0, t1)(lambda t: tile_piece(l, p, t, j0 + (t - t0) * nk, nk, b // p.split.st))

        @pl.when(wg == 1)
        def _producer():
            @pl.loop(0, L)
            def _(l):
                for i, p in enumerate(prods):
                    produce(l, i, p)

            total = L * per_layer

            @pl.loop(jnp.maximum(total - st, 0), total)
            def _(j):  # the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

        @pl.when(wg == 0)
        def _consumer():
            @pl.loop(0, L)
            def _(l):
                for i, p in enumerate(prods):
                    consume(l, i, p)

            @pl.when(b < D // T)
            def _final():  # chunk b of x_L, to y
                groups, _, _ = input_spec("final", L - 1, 0, prods, lay, F)
                _gather_call(ll, init_ref, out_smem, groups, out="f32", c0=b, c1=b, k0=b, use_init=0)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, y_ref.at[pl.ds(b * T, T)])
                plgpu.wait_smem_to_gmem(0)

    scratch = (
        tiled_smem((_window_rows(kmax), KC), jnp.bfloat16),  # the input window
        tiled_smem((st, T, KC), jnp.bfloat16),  # the weight ring
        plgpu.SMEM((T,), jnp.float32),  # a tile's 64 outputs, staged for their LL words
        plgpu.SMEM((T,), jnp.float32),  # the final chunk
        plgpu.SMEM((4,), jnp.float32),  # a norm's 4 warp partial sums of squares
        plgpu.Barrier(num_barriers=st),  # slot's tile landed
        plgpu.Barrier(num_barriers=st),  # slot free again
    )
    return launch(kernel, (init, w_qkv, w_o, w_gu, w_down),
                  out_type=jax.ShapeDtypeStruct((D,), jnp.float32), scratch=scratch, grid=(NB,),
                  grid_names=("b",), num_threads=2, interpret=False, manual_barriers=True,
                  name="decode_chain")


def smem_need(kmax: int, stages: int) -> int:
    return smem_bytes(((_window_rows(kmax), KC), jnp.bfloat16), ((stages, T, KC), jnp.bfloat16),
                      ((T,), jnp.float32), ((T,), jnp.float32), ((4,), jnp.float32))


def check(x0_D, w_qkv, w_o, w_gu, w_down):
    """Raises a ValueError naming what does not fit; returns (L, D, N1, F)."""
    shapes = tuple(a.shape for a in (x0_D, w_qkv, w_o, w_gu, w_down))
    wrong = ValueError(f"chain_mgpu: x0 {shapes[0]}, w_qkv {shapes[1]}, w_o {shapes[2]}, w_gu "
                       f"{shapes[3]}, w_down {shapes[4]}: want [D], [L, N1, D], [L, D, D], "
                       "[L, 2F, D], [L, D, F] with N1 >= D.")
    if [len(s) for s in shapes] != [1, 3, 3, 3, 3]:
        raise wrong
    (D,), (L, N1, D1), (L2, D2, D3), (L3, G, D4), (L4, D5, F) = shapes
    if len({L, L2, L3, L4}) != 1 or len({D, D1, D2, D3, D4, D5}) != 1 or G != 2 * F or N1 < D:
        raise wrong
    if D % T or N1 % T or F % T:
        raise ValueError(f"chain_mgpu: D={D}, N1={N1}, F={F} must be multiples of {T}.")
    if any(jnp.dtype(w.dtype) != jnp.bfloat16 for w in (w_qkv, w_o, w_gu, w_down)):
        raise ValueError("chain_mgpu: the weights must be bf16.")
    return L, D, N1, F


@functools.partial(jax.jit, static_argnames=("stages", "blocks", "norm_eps"))
def chain_mgpu(x0_D, w_qkv, w_o, w_gu, w_down, *, stages: int = 16, blocks: int | None = None,
               norm_eps: float | None = None):
    """fp32 x_L [D] of the module docstring's chain from fp32 x_0 [D]: one persistent kernel
    (GPU only: sm90). norm_eps: with RMSNorms before q|k|v and gate|up, their gains already
    folded into w_qkv's and w_gu's columns (`fold_norms`); None: no norms."""
    L, D, N1, F = check(x0_D, w_qkv, w_o, w_gu, w_down)
    NB = blocks or sm_count()
    prods = products(D, N1, F, NB)
    need = smem_need(max(p.kmax() for p in prods), stages)
    if need > SMEM_LIMIT - 2048:
        raise ValueError(f"chain_mgpu: stages={stages} needs {need} bytes of shared memory; use fewer.")
    if norm_eps is not None and D % 128:
        raise ValueError(f"chain_mgpu: norms need D={D} to be a multiple of 128.")
    return _kernel_call(x0_D, w_qkv, w_o, w_gu, w_down, prods, stages, NB, norm_eps)


def fold_norms(w_qkv, w_gu, g_attn_LD, g_mlp_LD):
    """w_qkv and w_gu with the RMSNorm gains folded into their columns (once, at load)."""
    fold = lambda w, g: (w.astype(jnp.float32) * g[:, None, :]).astype(jnp.bfloat16)  # noqa: E731
    return fold(w_qkv, g_attn_LD), fold(w_gu, g_mlp_LD)


def reference(x0_D, w_qkv, w_o, w_gu, w_down, norms=None, eps: float = 1e-5):
    """The same chain in XLA: each product's input rounded to bf16, fp32 sums. norms:
    (g_attn [L, D], g_mlp [L, D]) for RMSNorms before q|k|v and gate|up (unfolded)."""
    D, F = w_o.shape[1], w_down.shape[2]

    def mv(w, v):
        return jnp.einsum("NK,K->N", w, v.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    def rms(v, g_D):
        return v * lax.rsqrt(jnp.mean(v * v) + eps) * g_D

    x = x0_D.astype(jnp.float32)
    for l in range(w_qkv.shape[0]):
        a = mv(w_qkv[l], x if norms is None else rms(x, norms[0][l]))
        h = x + mv(w_o[l], a[:D])
        g = mv(w_gu[l], h if norms is None else rms(h, norms[1][l]))
        x = h + mv(w_down[l], jax.nn.silu(g[:F]) * g[F:])
    return x
