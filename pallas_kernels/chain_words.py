"""The inline-PTX movers of `chain_mgpu`'s low-latency (LL) words: a product's input
gathered from its writers' pieces (with residual, SwiGLU and RMSNorm factor) into the bf16
window the tensor core reads, and a norm's sums of squares. GPU only (sm90): Mosaic GPU's
interpreter does not run inline PTX.
"""
from __future__ import annotations

import struct

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_kernels._mgpu import SPIN_GUARD, const_i32
from pallas_kernels.chain_plan import KC

X_TRANSFORMS = (plgpu.TilingTransform((8, KC)), plgpu.SwizzleTransform(2 * KC))



def f32_hex(v: float) -> str:
    """A PTX fp32 immediate."""
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def _gather_ptx(n_a: int, n_b: int, dense: bool, out: str, norm: tuple[float, int] | None = None) -> str:
    """One lane's poll: operands $0.. the n_a + n_b source addresses, then their n expected
    tags, then (dense) the dense word's address, its write flag and its tag, then the
    shared-memory address. Sums group A (and B),
    writes A's sum as a dense word if asked, and stores bf16(A) or bf16(silu(A) * B)
    (out="bf16") or A as fp32 (out="f32"). norm=(eps, D): the operand before the last is the
    shared-memory address of 4 warp partial sums of squares of a D-vector (`_norm_ptx`); A
    and B are scaled by rsqrt(sum / D + eps) first (the RMSNorm whose gain is folded into
    the weights)."""
    n = n_a + n_b
    regs = " ".join(f".reg .b64 d{k}; .reg .b32 v{k}; .reg .b32 t{k};" for k in range(n))
    loads = " ".join(f"ld.relaxed.gpu.global.b64 d{k}, [${k}]; mov.b64 {{v{k}, t{k}}}, d{k};"
                     for k in range(n))
    checks = " ".join(f"setp.ne.b32 p, t{k}, ${n + k}; @p bra LAB_G;" for k in range(n))
    sum_a = " ".join(f"mov.b32 g, v{k}; add.f32 fa, fa, g;" for k in range(n_a))
    sum_b = " ".join(f"mov.b32 g, v{k}; add.f32 fb, fb, g;" for k in range(n_a, n))
    body = f"mov.f32 fa, 0f00000000; mov.f32 fb, 0f00000000; {sum_a} {sum_b}"
    i = 2 * n
    if dense:
        body += (f" setp.ne.u32 q, ${i + 1}, 0; mov.b32 w, fa; mov.b32 one, ${i + 2};"
                 f" mov.b64 dd, {{w, one}}; @q st.relaxed.gpu.global.b64 [${i}], dd;")
        i += 3
    if norm:
        eps, width = norm
        body += (f" ld.shared.f32 e, [${i}]; ld.shared.f32 g, [${i}+4]; add.f32 e, e, g;"
                 f" ld.shared.f32 g, [${i}+8]; add.f32 e, e, g; ld.shared.f32 g, [${i}+12]; add.f32 e, e, g;"
                 f" mul.f32 e, e, {f32_hex(1.0 / width)}; add.f32 e, e, {f32_hex(eps)};"
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


def gather(ll_ref, init_ref, dst_ref, groups, *, out: str, c0, c1, k0, use_init,
                 dense_base=None, dense_on=None, dense_tag=None, norm_ref=None, norm=None, k0_hi=None):
    """The inline op behind a product's input: lanes < 64 read column lane of chunk c0, the
    others column lane - 64 of chunk c1. groups: [(count, stride, is_b, base_word, init_ok)]
    with count/stride/is_b static (stride: words from one chunk to the next, 64 * sk for
    pieces, 64 for a dense vector) and base_word traced; init_ok: this group reads the host's
    words instead of the kernel's when use_init (layer 0). Writes row 0 of the chunk's 8-row
    group (chunk - k0) of the bf16 window dst_ref (tiled, swizzled: that row is linear), or
    in fp32 (out="f32") dst_ref[(chunk - k0) * 64 + col]; with dense_base, A's sum as a dense word at
    dense_base + chunk * 64 + col when dense_on != 0; k0_hi (default k0): the lanes >= 64
    write slot c1 - k0_hi instead of c1 - k0; with out="f32", dst_ref[(chunk - k0) * 64 + col]; with norm=(eps, D), the sums scaled by
    the RMSNorm factor from norm_ref's partials (`norm_partials`). Ends in a warpgroup barrier."""
    n_a = sum(g[0] for g in groups if not g[2])
    n_b = sum(g[0] for g in groups if g[2])
    dense = dense_base is not None
    ptx = _gather_ptx(n_a, n_b, dense, out, norm)
    # A's groups first, then B's, in the order the PTX sums them.
    ordered = [g for g in groups if not g[2]] + [g for g in groups if g[2]]
    splat = plgpu.Layout.WG_SPLAT
    k0_hi = k0 if k0_hi is None else k0_hi  # lanes >= 64 write slot c1 - k0_hi
    traced = [jnp.asarray(v, jnp.int32) for v in (c0, c1, k0, use_init, k0_hi)]
    traced += [jnp.asarray(g[3], jnp.int32) for g in ordered]
    traced += [jnp.asarray(g[5], jnp.int32) for g in ordered]
    if dense:
        traced += [jnp.asarray(dense_base, jnp.int32), jnp.asarray(dense_on, jnp.int32),
                   jnp.asarray(dense_tag, jnp.int32)]

    dst_type = plgpu.RefType(X_TRANSFORMS) if out == "bf16" else plgpu.RefType()
    refs = (ll_ref, init_ref, dst_ref) + ((norm_ref,) if norm else ())
    ref_types = (plgpu.RefType(), plgpu.RefType(), dst_type) + ((plgpu.RefType(),) if norm else ())

    @plgpu.inline_mgpu(arg_types=(ref_types, [splat] * len(traced)))
    def op(_, rs, vals):
        ll, init, dst = rs[:3]
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        v = [x.registers[()] for x in vals]
        c0_, c1_, k0_lo, init_flag, k0_hi_ = v[:5]
        ng = len(ordered)
        bases, tags = v[5:5 + ng], v[5 + ng:5 + 2 * ng]
        lane = arith.remui(mgpu.utils.thread_idx(), const_i32(128))
        col = arith.remui(lane, const_i32(64))
        hi = arith.cmpi(arith.CmpIPredicate.uge, lane, const_i32(64))
        chunk = arith.select(hi, c1_, c0_)
        k0_ = arith.select(hi, k0_hi_, k0_lo)
        ll_p = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ll))
        init_p = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(init))
        from_init = arith.cmpi(arith.CmpIPredicate.ne, init_flag, const_i32(0))

        def addr(ptr, word):
            return arith.addi(ptr, arith.muli(arith.extui(i64, word), mgpu.utils.c(8, i64)))

        addrs, want = [], []
        for (count, stride, _, _, init_ok, _), base, t in zip(ordered, bases, tags, strict=True):
            first = arith.addi(arith.addi(base, arith.muli(chunk, const_i32(stride))), col)
            ptr = arith.select(from_init, init_p, ll_p) if init_ok else ll_p
            addrs += [addr(ptr, arith.addi(first, const_i32(64 * j))) for j in range(count)]
            want += [t] * count
        operands = addrs + want
        if dense:
            dbase, don, dtag = v[5 + 2 * ng:]
            operands += [addr(ll_p, arith.addi(arith.addi(dbase, arith.muli(chunk, const_i32(64))), col)), don,
                         dtag]
        if norm:
            operands.append(llvm.ptrtoint(i32, mgpu.utils.memref_ptr(rs[3])))
        dst_p = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(dst))
        if out == "bf16":  # row 0 of 8-row group (chunk - k0): 1 KB a group, linear in the row
            off = arith.addi(arith.muli(arith.subi(chunk, k0_), const_i32(1024)), arith.muli(col, const_i32(2)))
        else:  # element (chunk - k0) * 64 + col
            off = arith.muli(arith.addi(arith.muli(arith.subi(chunk, k0_), const_i32(64)), col), const_i32(4))
        operands.append(arith.addi(dst_p, off))
        mgpu.utils.inline_ptx(ptx, *operands, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(refs, traced)


def _norm_ptx(per_lane: int) -> str:
    """Operands: $0 the address of dense word `lane` of a vector (words lane + 128 i,
    i < per_lane), $1 the lane, $2 the 4-float shared scratch, $3 the words' tag. Polls the words, sums their
    squares, reduces the warp by butterfly shuffles, and lane 0 of each warp stores its sum."""
    regs = " ".join(f".reg .b64 d{k}; .reg .b32 v{k}; .reg .b32 t{k}; .reg .u64 a{k};" for k in range(per_lane))
    addrs = "mul.wide.u32 a0, $1, 8; add.u64 a0, a0, $0; " + " ".join(
        f"add.u64 a{k}, a{k - 1}, 1024;" for k in range(1, per_lane))
    loads = " ".join(f"ld.relaxed.gpu.global.b64 d{k}, [a{k}]; mov.b64 {{v{k}, t{k}}}, d{k};" for k in range(per_lane))
    checks = " ".join(f"setp.ne.b32 p, t{k}, $3; @p bra LAB_N;" for k in range(per_lane))
    squares = " ".join(f"mov.b32 x, v{k}; fma.rn.f32 s, x, x, s;" for k in range(per_lane))
    shuffle = " ".join(f"mov.b32 r, s; shfl.sync.bfly.b32 r, r, {m}, 31, -1; mov.b32 x, r; add.f32 s, s, x;"
                       for m in (16, 8, 4, 2, 1))
    return (f"{{ .reg .pred p; .reg .u32 n; .reg .f32 s; .reg .f32 x; .reg .b32 r; .reg .u32 w; {regs}"
            f" {addrs} mov.u32 n, 0; LAB_N: {loads} {SPIN_GUARD} {checks} mov.f32 s, 0f00000000;"
            f" {squares} {shuffle} and.b32 w, $1, 31; setp.ne.u32 p, w, 0; shr.u32 w, $1, 5;"
            f" shl.b32 w, w, 2; add.u32 w, w, $2; @!p st.shared.f32 [w], s; }}")


def norm_partials(ll_ref, init_ref, scratch_ref, base_word, from_init, init_ok: bool, width: int, tag):
    """The 4 warp partial sums of squares of the dense D-vector at LL word base_word (the
    host's words when init_ok and from_init), written with `tag`, into scratch_ref; then a
    warpgroup barrier."""
    if width % 128:
        raise ValueError(f"chain_mgpu norms: D={width} must be a multiple of 128.")
    ptx = _norm_ptx(width // 128)
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), splat, splat, splat))
    def op(_, ll, init, scratch, base, flag, want):
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        lane = arith.remui(mgpu.utils.thread_idx(), const_i32(128))
        ll_p = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(ll))
        ptr = ll_p
        if init_ok:
            from_init_ = arith.cmpi(arith.CmpIPredicate.ne, flag.registers[()], const_i32(0))
            ptr = arith.select(from_init_, llvm.ptrtoint(i64, mgpu.utils.memref_ptr(init)), ll_p)
        start = arith.addi(ptr, arith.muli(arith.extui(i64, base.registers[()]), mgpu.utils.c(8, i64)))
        sc = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(scratch))
        mgpu.utils.inline_ptx(ptx, start, lane, sc, want.registers[()], has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(ll_ref, init_ref, scratch_ref, jnp.asarray(base_word, jnp.int32), jnp.asarray(from_init, jnp.int32),
       jnp.asarray(tag, jnp.int32))
