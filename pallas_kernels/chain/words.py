"""The inline-PTX movers of `chain_mgpu`'s low-latency (LL) words: a product's input
gathered from its writers' pieces (with residual, SwiGLU and RMSNorm factor) into the bf16
window the tensor core reads (polling the RMSNorm's vector in the same round trip). GPU only (sm90): Mosaic GPU's
interpreter does not run inline PTX.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from pallas_kernels._mgpu import (
    SPIN_GUARD,
    const_i32,
    gmem_address,
    lane,
    ptr32,
    ptr64,
    read_ref,
    warp_retry,
)
from pallas_kernels.chain.plan import EPOCHS, KC, SS, T

X_TRANSFORMS = (plgpu.TilingTransform((8, KC)), plgpu.SwizzleTransform(2 * KC))


class PollGroup(NamedTuple):
    """A source group as the poll's PTX sees it (`_gather_ptx`): `count` words 512 bytes
    apart (packed: read by a lane pair, `_source_words`), the next chunk's `stride` bytes on;
    is_b: summed into SwiGLU's up."""

    count: int
    is_b: bool
    stride: int
    packed: bool
    lse: bool = False  # the log2-sum-exps weighting the values group's words (`_source_words`)


def f32_hex(v: float) -> str:
    """A PTX fp32 immediate."""
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def _gather_ptx(groups: tuple[PollGroup, ...], dense: bool, out: str,
                norm: tuple[float, int] | None = None, poll_norm: int = 0, passes: int = 1,
                dense_advance: int = 0, dst_advance: int = 0, chunk_step: int = 2,
                dense_ss: bool = False, norm_sums: int = 0) -> str:
    """One lane's poll of `passes` passes at once. groups: `PollGroup`s, A's first: `count` words 64 apart (512 bytes; packed: 32, two values a word, `plan.pack`,
    read by a lane pair, half the words each: `_source_words`), the next chunk's `stride` bytes
    further.
    Operands: $0.. each group's first address (pass 0, word 0), then each group's
    expected tag, then (dense) the dense word's address, its write flag and its tag, then
    (poll_norm) the norm's operands, then (norm) the partials' address, then the
    shared-memory destination of pass 0, this lane's pass-0 chunk and the limit. Pass i reads
    chunk + i chunk_step (ignored unless below the limit: its words are then read from
    chunk limit - 1, always one of the lane's, so that no load is predicated: predicated
    loads keep every loaded register live around the poll loop, which spilled the 1b
    kernel), its dense word dense_advance and its destination dst_advance bytes a pass
    further. Every pass's words are loaded before
    any is checked: one round trip to L2 for all. Sums group A (and B), writes A's sum as a
    dense word if asked, and stores bf16(A) or bf16(silu(A) * B) (out="bf16") or A as fp32
    (out="f32"). norm=(eps, D): A and B are scaled by rsqrt(sum / D + eps) of 4 warp partial
    sums of squares of a D-vector (the RMSNorm whose gain is folded into the weights).
    poll_norm=k (with norm): those partial sums are made here, in the same poll as the
    sources: its operands are the address of this lane's first word of the D-vector (words
    lane + 128 i, i < k), their tag, the warpgroup's barrier id and the lane; each warp's sum
    of squares goes to the shared partials, then a warpgroup barrier, then the scaling.
    norm_sums=n (with poll_norm): the vector is given by its n square sums instead (`plan.SS`
    values a word; the first operand is then the address of word 0): lane i reads words
    i + 128 j and adds them up as its sum of squares. dense_ss (with dense): one more dense
    operand, this lane's pass-0 square-sum word: lane 0 of each warp writes the sum of squares
    of its warp's 32 dense values there (pass i's: 2 i chunk_step words further)."""
    G = len(groups)
    P = range(passes)
    regs, loads, checks, sums, packed, any_b, pair_groups = _source_words(groups, P)
    j = 2 * G + ((4 if dense_ss else 3) if dense else 0)  # the first poll_norm operand
    setup = ""
    if poll_norm:
        nregs, setup, nloads, nchecks, nbody = _norm_poll(poll_norm, norm_sums, j)
        regs, loads, checks = regs + nregs, loads + nloads, checks + nchecks
    body = "".join(sums)
    i_op = 2 * G
    if dense:
        dregs, dbody = _dense_store(P, i_op, dense_advance, dense_ss, chunk_step)
        regs, body = regs + dregs, body + dbody
        i_op += 4 if dense_ss else 3
    if poll_norm:  # this warp's sum of squares to partial `warp`, then the warpgroup's barrier
        body += nbody
        i_op += 4
    if norm:
        eps, width = norm
        body += (f" ld.shared.f32 e, [${i_op}]; ld.shared.f32 g, [${i_op}+4]; add.f32 e, e, g;"
                 f" ld.shared.f32 g, [${i_op}+8]; add.f32 e, e, g; ld.shared.f32 g, [${i_op}+12]; add.f32 e, e, g;"
                 f" mul.f32 e, e, {f32_hex(1.0 / width)}; add.f32 e, e, {f32_hex(eps)}; rsqrt.approx.f32 e, e;"
                 + " ".join(f" mul.f32 fa{i}, fa{i}, e; mul.f32 fb{i}, fb{i}, e;" for i in P))
        i_op += 1
    for i in P:
        if any_b:  # silu(a) * b = a / (1 + 2^(-a log2 e)) * b
            body += (f" mul.f32 e, fa{i}, 0fBFB8AA3B; ex2.approx.f32 e, e; add.f32 e, e, 0f3F800000;"
                     f" div.approx.f32 fa{i}, fa{i}, e; mul.f32 fa{i}, fa{i}, fb{i};")
        if out == "bf16":
            body += f" cvt.rn.bf16.f32 h, fa{i}; @ok{i} st.shared.b16 [${i_op}+{i * dst_advance}], h;"
        else:
            body += f" @ok{i} st.shared.f32 [${i_op}+{i * dst_advance}], fa{i};"
    valid = " ".join(f"add.u32 c, ${i_op + 1}, {i * chunk_step}; setp.lt.u32 ok{i}, c, ${i_op + 2};" for i in P)
    # While waiting, each lane polls one word (its first), not all of them: a full poll is up
    # to ~48 KB of L2 reads a block a round trip, which with every block waiting competes
    # with the weight stream; then the full poll (usually once). Both loops are the warp's,
    # not the lane's (`warp_retry`): divergent loops make ptxas serialise the kernel's wgmma.
    probe = (f"LAB_W: ld.relaxed.gpu.global.b64 pw, [a0_0];{_split('pw', 'pv', 'pt', groups[0].packed)} {SPIN_GUARD}"
             f" setp.ne.b32 p, pt, ${G}; {warp_retry('p', 'LAB_W')}")
    # pass i's chunks offset: min(i chunk_step, limit - 1 - chunk) chunks (signed)
    valid += f" sub.s32 lc, ${i_op + 2}, 1; sub.s32 lc, lc, ${i_op + 1};"
    if packed:  # the lane's parity in its pair, and the odd lane's one-word shift
        valid += " mov.u32 lp, %laneid; and.b32 lp, lp, 1; setp.ne.u32 podd, lp, 0; mul.wide.u32 p256, lp, 256;"
    valid += " ".join(f" min.s32 c, lc, {i * chunk_step}; mul.wide.s32 off, c, {groups[g].stride}; add.s64 a{g}_{i}, ${g}, off;"
                      for i in P for g in range(G))
    valid += " ".join(f" add.s64 sa{g}_{i}, a{g}_{i}, p256;" for g in pair_groups for i in P)
    return (f"{{ .reg .pred p; .reg .pred bad; .reg .pred q; .reg .pred qq; .reg .u32 n; .reg .s32 c; .reg .s32 lc; .reg .b64 off;"
            f" .reg .f32 g; .reg .f32 e; .reg .b32 w; .reg .b32 one; .reg .b64 dd; .reg .b16 h;"
            f" .reg .b64 pw; .reg .b32 pv; .reg .b32 pt; {regs} {valid} {setup}"
            f" mov.u32 n, 0; {probe} LAB_G: {loads} {SPIN_GUARD} mov.pred bad, 0; {checks}"
            f" {warp_retry('bad', 'LAB_G')} {body} }}")


def _source_words(groups, P):
    """The words a lane polls for its sources, and what it makes of them (`_gather_ptx`):
    (regs, loads, checks, sums, packed_any, any_b, pair_groups), sums a pass's PTX summing
    group A into fa{i} and B into fb{i}. A packed group's words serve a lane pair (columns
    2 i, 2 i + 1): the even lane reads pieces 0, 2, .., the odd one 1, 3, .. (its address `sa`
    a word further), each taking both values of a word; an odd count's last piece both read
    and the even lane counts. The pair then swaps sums (`shfl.bfly 1`): half the loads a
    lane, half the bytes. A group with `lse` (an attention split's log2-sum-exps, one a word
    of the values group before it, `plan.input_spec`): A is then the splits' weighted mean,
    sum_k 2^(lse_k - M) v_k / sum_k 2^(lse_k - M), M the largest lse."""
    G = len(groups)
    word = []  # word k: (its group, from the pair-shifted address, byte offset, even lane's only)
    for g, (count, _, _, pk, _) in enumerate(groups):
        if not pk:
            word += [(g, False, 512 * j, False) for j in range(count)]
            continue
        word += [(g, True, 512 * m, False) for m in range(count // 2)]
        if count % 2:
            word.append((g, False, 256 * (count - 1), True))
    n = len(word)
    packed = [groups[g].packed for g, *_ in word]
    is_b = [groups[g].is_b for g, *_ in word]
    regs = " ".join(f".reg .b64 d{i}_{k}; .reg .b32 v{i}_{k}; .reg .b32 t{i}_{k};" for i in P for k in range(n))
    regs += " " + " ".join(f".reg .pred ok{i}; .reg .f32 fa{i}; .reg .f32 fb{i};" for i in P)
    regs += " " + " ".join(f".reg .b64 a{g}_{i};" for g in range(G) for i in P)
    pair_groups = [g for g in range(G) if groups[g].packed and groups[g].count > 1]
    regs += " " + " ".join(f".reg .b64 sa{g}_{i};" for g in pair_groups for i in P)
    loads = " ".join(f"ld.relaxed.gpu.global.b64 d{i}_{k}, [{'sa' if shifted else 'a'}{g}_{i}+{off}];"
                     f"{_split(f'd{i}_{k}', f'v{i}_{k}', f't{i}_{k}', packed[k])}"
                     for i in P for k, (g, shifted, off, _) in enumerate(word))
    if any(packed):
        regs += (" .reg .b64 dx; .reg .b32 ue; .reg .b32 uo; .reg .u32 lp; .reg .pred podd; .reg .b64 p256;"
                 " .reg .f32 xs; .reg .f32 xm; .reg .f32 xr; .reg .b32 xb;"
                 + " ".join(f" .reg .f32 e{x}{i}; .reg .f32 o{x}{i};" for x in "ab" for i in P))
    checks = " ".join(f"setp.ne.and.b32 p, t{i}_{k}, ${G + g}, ok{i}; or.pred bad, bad, p;"
                      for i in P for k, (g, *_) in enumerate(word))
    pair_sums = sorted({"b" if is_b[k] else "a" for k in range(n) if packed[k]})
    sums = []
    if any(g.lse for g in groups):  # the splits' merge: values then their lse words
        assert G == 2 and groups[1].lse and not any(packed + is_b) and groups[0].count == groups[1].count
        R = groups[0].count
        regs += " .reg .f32 mm, mw, mn, md;"
        for i in P:
            body = f" mov.f32 fb{i}, 0f00000000; mov.b32 mm, v{i}_{R};"
            body += "".join(f" mov.b32 g, v{i}_{R + k}; max.f32 mm, mm, g;" for k in range(1, R))
            body += " mov.f32 mn, 0f00000000; mov.f32 md, 0f00000000;"
            body += "".join(f" mov.b32 g, v{i}_{R + k}; sub.f32 g, g, mm; ex2.approx.f32 mw, g; add.f32 md, md, mw;"
                            f" mov.b32 g, v{i}_{k}; fma.rn.f32 mn, mw, g, mn;" for k in range(R))
            sums.append(body + f" div.rn.f32 fa{i}, mn, md;")
        return regs, loads, checks, sums, False, False, pair_groups
    for i in P:
        body = f" mov.f32 fa{i}, 0f00000000; mov.f32 fb{i}, 0f00000000;"
        for x in pair_sums:
            body += f" mov.f32 e{x}{i}, 0f00000000; mov.f32 o{x}{i}, 0f00000000;"
        for k in range(n):
            x = "b" if is_b[k] else "a"
            if not packed[k]:
                body += f" mov.b32 g, v{i}_{k}; add.f32 f{x}{i}, f{x}{i}, g;"
                continue
            body += (f" shr.b64 dx, d{i}_{k}, 16; cvt.u32.u64 ue, dx; and.b32 ue, ue, 16777215; shl.b32 ue, ue, 8;"
                     f" shr.b64 dx, d{i}_{k}, 40; cvt.u32.u64 uo, dx; shl.b32 uo, uo, 8;")
            if word[k][3]:  # read by both lanes of the pair, counted by the even one
                body += " @podd mov.b32 ue, 0; @podd mov.b32 uo, 0;"
            body += f" mov.b32 g, ue; add.f32 e{x}{i}, e{x}{i}, g; mov.b32 g, uo; add.f32 o{x}{i}, o{x}{i}, g;"
        for x in pair_sums:
            # the partner needs the other column: the even lane sends its odd sum and keeps its even one
            body += (f" selp.f32 xs, e{x}{i}, o{x}{i}, podd; mov.b32 xb, xs; shfl.sync.bfly.b32 xb, xb, 1, 31, -1;"
                     f" mov.b32 xr, xb; selp.f32 xm, o{x}{i}, e{x}{i}, podd; add.f32 f{x}{i}, f{x}{i}, xm;"
                     f" add.f32 f{x}{i}, f{x}{i}, xr;")
        sums.append(body)
    return regs, loads, checks, sums, any(packed), any(is_b), pair_groups


def _split(d, v, t, packed):
    """PTX: a loaded word d's value v and tag t (packed: the tag's 16 bits; the values later)."""
    if packed:
        return f" cvt.u32.u64 {t}, {d}; and.b32 {t}, {t}, 65535;"
    return f" mov.b64 {{{v}, {t}}}, {d};"


def _warp_sum(acc: str, bits: str, tmp: str) -> str:
    """PTX: the fp32 register acc summed over the warp (a butterfly; every lane gets the sum),
    through the b32 register bits and the fp32 register tmp."""
    return " ".join(f"mov.b32 {bits}, {acc}; shfl.sync.bfly.b32 {bits}, {bits}, {m}, 31, -1; "
                    f"mov.b32 {tmp}, {bits}; add.f32 {acc}, {acc}, {tmp};" for m in (16, 8, 4, 2, 1))


def _norm_poll(k: int, norm_sums: int, j: int):
    """The RMSNorm's vector (or its square sums) polled with the sources, `k` words a lane
    from operand $j (`_gather_ptx`'s poll_norm): (regs, setup, loads, checks, body), body
    leaving each warp's sum of squares in the shared partials after a warpgroup barrier."""
    regs = " ".join(f" .reg .b64 nd{m}; .reg .b32 nv{m}; .reg .b32 nt{m};" for m in range(k))
    regs += " .reg .f32 s2; .reg .f32 x2; .reg .b32 r2; .reg .u32 w2; .reg .pred z;"
    setup = ""
    if norm_sums:  # word lane + 128 m if there is one (else the last word, not added)
        regs += " .reg .u32 ni;" + " ".join(f" .reg .b64 na{m}; .reg .pred nz{m};" for m in range(k))
        setup = " ".join(f"add.u32 ni, ${j + 3}, {128 * m}; setp.lt.u32 nz{m}, ni, {norm_sums};"
                         f" min.u32 ni, ni, {norm_sums - 1}; mul.wide.u32 off, ni, 8; add.s64 na{m}, ${j}, off;"
                         for m in range(k))
        address = [f"na{m}" for m in range(k)]
    else:
        address = [f"${j}+{1024 * m}" for m in range(k)]
    loads = " " + " ".join(f"ld.relaxed.gpu.global.b64 nd{m}, [{address[m]}]; mov.b64 {{nv{m}, nt{m}}}, nd{m};"
                           for m in range(k))
    checks = " " + " ".join(f"setp.ne.b32 p, nt{m}, ${j + 1}; or.pred bad, bad, p;" for m in range(k))
    square = [f"@nz{m} add.f32 s2, s2, x2;" if norm_sums else "fma.rn.f32 s2, x2, x2, s2;" for m in range(k)]
    body = (" mov.f32 s2, 0f00000000; " + " ".join(f"mov.b32 x2, nv{m}; {square[m]}" for m in range(k))
            + " " + _warp_sum("s2", "r2", "x2")
            + f" and.b32 w2, ${j + 3}, 31; setp.eq.u32 z, w2, 0; shr.u32 w2, ${j + 3}, 5; shl.b32 w2, w2, 2;"
            f" add.u32 w2, w2, ${j + 4}; @z st.shared.f32 [w2], s2; bar.sync ${j + 2}, 128;")
    return regs, setup, loads, checks, body


def _dense_store(P, i_op: int, advance: int, dense_ss: bool, chunk_step: int):
    """A's sums as dense words from operand $i_op (address, write flag, tag; with dense_ss the
    square-sum word's address next: lane 0 of each warp stores its warp's): (regs, body)."""
    regs = ""
    body = f" setp.ne.u32 q, ${i_op + 1}, 0; mov.b32 one, ${i_op + 2};"
    if dense_ss:  # lane 0 of each warp writes its warp's sum of squares
        regs = " .reg .f32 q2; .reg .f32 qx; .reg .b32 qr; .reg .u32 ql; .reg .pred l0; .reg .pred qy;"
        body += " mov.u32 ql, %laneid; setp.eq.u32 l0, ql, 0;"
    for i in P:
        body += (f" and.pred qq, q, ok{i}; mov.b32 w, fa{i}; mov.b64 dd, {{w, one}};"
                 f" @qq st.relaxed.gpu.global.b64 [${i_op}+{i * advance}], dd;")
        if dense_ss:
            body += (f" mul.f32 q2, fa{i}, fa{i}; "
                     + _warp_sum("q2", "qr", "qx")
                     + f" and.pred qy, qq, l0; mov.b32 w, q2; mov.b64 dd, {{w, one}};"
                     f" @qy st.relaxed.gpu.global.b64 [${i_op + 3}+{i * 16 * chunk_step}], dd;")
    return regs, body


def gather(ll_ref, init_ref, dst_ref, groups, reads, *, out: str, use_init, dense_base=None,
           dense_on=None, dense_tag=None, dense_ss=None, norm_ref=None, norm=None, poll_norm=None,
           sums: bool = False):
    """The inline op behind a product's input, one poll round (`plan.Reads`: which
    chunk each lane reads into which slot, pass by pass, all passes' words polled at once).
    groups: [`plan.Source`] (stride: words from one chunk to the next, 64 (packed: 32) * sk
    for pieces, 64 for a dense vector; base_word traced); init_ok: the group reads the host's
    words instead of the kernel's when use_init (layer 0). Writes row 0 of the slot's 8-row group of the bf16 window dst_ref
    (tiled, swizzled: that row is linear), or in fp32 (out="f32") dst_ref[slot * 64 + col];
    with dense_base, A's sum as a dense word at dense_base + chunk * 64 + col when
    dense_on != 0; with norm=(eps, D), the sums scaled by the RMSNorm factor from norm_ref's 4
    warp partial sums of squares (made by an earlier round, or with poll_norm=(base_word,
    from_init, init_ok, tag) of the dense D-vector there, in this round's poll; sums: of its
    D / SS square sums there, `plan.SS`). dense_ss: with dense_base, the first of the dense
    vector's square-sum words, written as well. Ends in a warpgroup barrier."""
    dense = dense_base is not None
    n_sums = per_lane = 0  # the norm's square sums polled, and the words a lane polls of them
    if poll_norm is not None:  # (or of the vector itself, without sums)
        n_sums = norm[1] // SS if sums else 0
        per_lane = -(-n_sums // 128) if n_sums else norm[1] // 128
    # A's groups first, then B's, in the order the PTX sums them.
    ordered = [g for g in groups if not g.is_b] + [g for g in groups if g.is_b]
    step = reads.chunk_step
    spec = tuple(PollGroup(g.count, g.is_b, 8 * g.stride, g.packed, g.lse) for g in ordered)
    ptx = _gather_ptx(spec, dense, out, norm, per_lane, reads.passes, 8 * 64 * step,
                      reads.slot_step * (1024 if out == "bf16" else 256), step, dense_ss is not None, n_sums)
    splat = plgpu.Layout.WG_SPLAT
    traced = [jnp.asarray(v, jnp.int32) for v in (*reads.chunks, *reads.slots, reads.limit, use_init)]
    traced += [jnp.asarray(g.base_word, jnp.int32) for g in ordered]
    traced += [jnp.asarray(g.tag, jnp.int32) for g in ordered]
    if dense:
        traced += [jnp.asarray(dense_base, jnp.int32), jnp.asarray(dense_on, jnp.int32),
                   jnp.asarray(dense_tag, jnp.int32)]
        if dense_ss is not None:
            traced.append(jnp.asarray(dense_ss, jnp.int32))
    n_dense = len(traced)
    if per_lane:
        nb, nfrom, n_init_ok, ntag = poll_norm
        traced += [jnp.asarray(nb, jnp.int32), jnp.asarray(nfrom, jnp.int32) & int(n_init_ok),
                   jnp.asarray(ntag, jnp.int32)]

    dst_type = plgpu.RefType(X_TRANSFORMS) if out == "bf16" else plgpu.RefType()
    refs = (ll_ref, init_ref, dst_ref) + ((norm_ref,) if norm else ())
    ref_types = (read_ref(), read_ref(), dst_type) + ((plgpu.RefType(),) if norm else ())

    @plgpu.inline_mgpu(arg_types=(ref_types, [splat] * len(traced)))
    def op(_, rs, vals):
        ll, init, dst = rs[:3]
        v = [x.registers[()] for x in vals]
        c_lo, c_hi, s_lo, s_hi, limit, init_flag = v[:6]
        ng = len(ordered)
        bases, tags = v[6:6 + ng], v[6 + ng:6 + 2 * ng]
        lane_ = lane()
        col = arith.remui(lane_, const_i32(64))
        hi = arith.cmpi(arith.CmpIPredicate.uge, lane_, const_i32(64))
        chunk = arith.select(hi, c_hi, c_lo)
        slot = arith.select(hi, s_hi, s_lo)
        ll_p, init_p = ptr64(ll), ptr64(init)
        from_init = arith.cmpi(arith.CmpIPredicate.ne, init_flag, const_i32(0))

        addrs, want = [], []
        half = arith.divui(col, const_i32(2))  # a packed piece's word of this lane's column
        for g, base, t in zip(ordered, bases, tags, strict=True):
            first = arith.addi(arith.addi(base, arith.muli(chunk, const_i32(g.stride))), half if g.packed else col)
            ptr = arith.select(from_init, init_p, ll_p) if g.init_ok else ll_p
            addrs.append(gmem_address(ptr, first, 8))
            want.append(t)
        operands = addrs + want
        if dense:
            dbase, don, dtag = v[6 + 2 * ng:6 + 2 * ng + 3]
            dword = arith.addi(arith.addi(dbase, arith.muli(chunk, const_i32(64))), col)
            operands += [gmem_address(ll_p, dword, 8), don, dtag]
            if dense_ss is not None:  # word 2 chunk + col / 32: this lane's warp's
                ss_word = arith.addi(arith.muli(chunk, const_i32(T // SS)), arith.divui(col, const_i32(SS)))
                operands.append(gmem_address(ll_p, arith.addi(v[6 + 2 * ng + 3], ss_word), 8))
        if per_lane:
            nb_, nfrom_, ntag_ = v[n_dense:]
            nptr = arith.select(arith.cmpi(arith.CmpIPredicate.ne, nfrom_, const_i32(0)), init_p, ll_p)
            first_word = nb_ if n_sums else arith.addi(nb_, lane_)  # square sums: word 0 (the PTX adds the lane)
            operands += [gmem_address(nptr, first_word, 8), ntag_, mgpu.utils.warpgroup_barrier_idx(sync=False), lane_]
        if norm:
            operands.append(ptr32(rs[3]))
        dst_p = ptr32(dst)
        if out == "bf16":  # row 0 of the slot's 8-row group: 1 KB a group, linear in the row
            off = arith.addi(arith.muli(slot, const_i32(1024)), arith.muli(col, const_i32(2)))
        else:  # element slot * 64 + col
            off = arith.muli(arith.addi(arith.muli(slot, const_i32(64)), col), const_i32(4))
        operands += [arith.addi(dst_p, off), chunk, limit]
        mgpu.utils.inline_ptx(ptx, *operands, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op(refs, traced)


def ll_store_rows(ll_ref, src_smem, word, tag, rows: int, row_words: int, count=None,
                  packed: bool = False):
    """Rows of 64 fp32 values as LL words: src_smem [rows, 64] (written before a
    `commit_smem()`), row r's to words word + r row_words + i (i < 64), tagged `tag`; rows
    at and past `count` (traced, at least 1; None: all `rows`) are not stored. Each lane stores
    ceil(rows / 2) words with relaxed 64-bit stores (as `_mgpu.ll_store`): a query group's
    heads (`row_words` = head_dim) or a block's tiles' pieces (sk 64 words apart). packed: two
    values a word (`plan.pack`: values 2 i and 2 i + 1 in word i < 32 of the row, a 16-bit
    tag). Ends in a warpgroup barrier (before src_smem is written again)."""
    per_row = 32 if packed else 64  # words a row
    n = rows * per_row
    if rows == 1:  # its one row is stored whatever the count
        count = None
    limit = str(n) if count is None else "$5"
    shift = 5 if packed else 6
    body = ""
    for k in range(-(-n // 128)):
        body += (f" add.u32 e, $3, {128 * k}; setp.lt.u32 p, e, {limit}; @!p bra LLH_{k};"
                 f" shr.u32 r, e, {shift}; and.b32 o, e, {per_row - 1}; mad.lo.u32 r, r, {row_words}, o; add.u32 r, r, $1;"
                 " mul.wide.u32 g, r, 8; add.u64 g, g, $0;")
        if packed:  # word e holds values 2 e, 2 e + 1 of the [rows, 64] source (8 e bytes in)
            body += (" shl.b32 o, e, 3; add.u32 o, o, $4; ld.shared.v2.b32 {a, b}, [o];"
                     " add.u32 a, a, 128; shr.u32 a, a, 8; add.u32 b, b, 128; shr.u32 b, b, 8;"
                     " shl.b32 lo, a, 16; or.b32 lo, lo, $2; shr.u32 hi, a, 16; shl.b32 b, b, 8; or.b32 hi, hi, b;"
                     f" mov.b64 d, {{lo, hi}}; st.relaxed.gpu.global.b64 [g], d; LLH_{k}:")
        else:
            body += (" shl.b32 o, e, 2; add.u32 o, o, $4; ld.shared.b32 v, [o];"
                     f" mov.b64 d, {{v, $2}}; st.relaxed.gpu.global.b64 [g], d; LLH_{k}:")
    ptx = ("{ .reg .pred p; .reg .b32 v, a, b, lo, hi; .reg .u32 e, r, o; .reg .b64 d, g;" + body + " }")
    splat = plgpu.Layout.WG_SPLAT
    vals = [jnp.asarray(word, jnp.int32), jnp.asarray(tag, jnp.int32)]
    if count is not None:
        vals.append(jnp.asarray(count, jnp.int32) * per_row)

    @plgpu.inline_mgpu(arg_types=((plgpu.RefType(), plgpu.RefType()), [splat] * len(vals)))
    def op(_, refs, vals):
        ll, src = refs
        w, t, *c = (v.registers[()] for v in vals)
        mgpu.utils.inline_ptx(ptx, ptr64(ll), w, t, lane(), ptr32(src), *c, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op((ll_ref, src_smem), vals)


def ll_store_heads(ll_ref, src_smem, word, tag, heads: int, head_dim: int):
    """`heads` query heads' 64 outputs of one chunk as LL words (`ll_store_rows`): src_smem
    [heads, 64], head g's to words word + g head_dim + i."""
    ll_store_rows(ll_ref, src_smem, word, tag, heads, head_dim)


def close_call(state_ref, word: int, blocks: int, pos_ref=None, steps: int = 1):
    """The end of a block's part in a call that keeps its words (`chain_mgpu(state=...)`):
    lane 0 counts the block out (an acquire-release add, gpu scope, on int32 word + 1 of
    state_ref), and the block that counts `blocks` resets the count and advances the epoch
    (int32 `word`) by `steps` (mod `plan.EPOCHS`: a step an epoch), which the next call's
    blocks read, and with pos_ref the position (int32 [1]) by `steps` (`chain_mgpu(advance=True)`). Every block
    read both before it counted itself out, so none of this call's reads the next ones. Ends
    in nothing: call it last. GPU only (inline PTX)."""
    ptx = ("{ .reg .pred p, q; .reg .u32 old, e; mov.u32 old, 0; setp.eq.u32 p, $1, 0;"
           " @p atom.acq_rel.gpu.global.add.u32 old, [$0+4], 1;"
           f" setp.eq.and.u32 q, old, {blocks - 1}, p;"
           f" @q ld.relaxed.gpu.global.u32 e, [$0]; @q add.u32 e, e, {steps}; @q and.b32 e, e, {EPOCHS - 1};"
           " @q st.relaxed.gpu.global.u32 [$0+4], 0; @q st.relaxed.gpu.global.u32 [$0], e;")
    if pos_ref is not None:
        ptx += f" @q ld.relaxed.gpu.global.u32 e, [$2]; @q add.u32 e, e, {steps}; @q st.relaxed.gpu.global.u32 [$2], e;"
    ptx += " }"
    refs = (state_ref,) + ((pos_ref,) if pos_ref is not None else ())

    @plgpu.inline_mgpu(arg_types=((plgpu.RefType(),) * len(refs),))
    def op(_, rs):
        i64 = ir.IntegerType.get_signless(64)
        at = arith.addi(ptr64(rs[0]), mgpu.utils.c(4 * word, i64))
        mgpu.utils.inline_ptx(ptx, at, lane(), *(ptr64(r) for r in rs[1:]), has_side_effects=True)

    op(refs)


def embed_words(ll_ref, table_ref, token, chunk, x_word: int, ss_word: int, tag):
    """x_0's chunk `chunk` as the host's words, from row `token` (traced; in the table) of the
    embedding table (`chain_mgpu(embed=...)`): lanes 0-63 read table[token, 64 chunk + lane]
    (bf16), store its fp32 as the LL word x_word + 64 chunk + lane, and lane 0 of each of
    their warps the warp's sum of squares as word ss_word + 2 chunk + warp (`SS` values a
    word, summed as the dense vectors' writers sum them), all tagged `tag`. Ends in a
    warpgroup barrier. GPU only (inline PTX)."""
    D = table_ref.shape[1]
    assert SS == 32 and T == 64, "one warp a square-sum word, two a chunk"
    ptx = ("{ .reg .pred p, l0; .reg .b16 h; .reg .f32 x, s, t; .reg .b32 w, bits; .reg .u32 ln, col, e;"
           " .reg .u64 a; .reg .b64 d;"
           " mov.u32 ln, $4; and.b32 col, ln, 63; setp.lt.u32 p, ln, 64;"
           f" mad.lo.u32 e, $1, {D}, col; mad.wide.u32 a, e, 2, $0;"
           " ld.global.nc.b16 h, [a]; cvt.f32.bf16 x, h;"
           " mov.b32 w, x; mov.b64 d, {w, $3};"
           " mul.wide.u32 a, col, 8; add.u64 a, a, $2; @p st.relaxed.gpu.global.b64 [a], d;"
           " mul.f32 s, x, x; " + _warp_sum("s", "bits", "t")
           + " and.b32 e, ln, 31; setp.eq.u32 l0, e, 0; and.pred l0, l0, p;"
           " mov.b32 w, s; mov.b64 d, {w, $3}; shr.u32 e, ln, 5; mul.wide.u32 a, e, 8; add.u64 a, a, $5;"
           " @l0 st.relaxed.gpu.global.b64 [a], d; }")
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=((plgpu.RefType(), read_ref()), [splat, splat, splat]))
    def op(_, refs, vals):
        ll, table = refs
        row, c, t = (v.registers[()] for v in vals)
        base = arith.muli(c, const_i32(T))
        x_at = gmem_address(ptr64(ll), arith.addi(base, const_i32(x_word)), 8)
        ss_at = gmem_address(ptr64(ll), arith.addi(arith.muli(c, const_i32(2)), const_i32(ss_word)), 8)
        mgpu.utils.inline_ptx(ptx, gmem_address(ptr64(table), base, 2), row, x_at, t, lane(), ss_at,
                              has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    op((ll_ref, table_ref), [jnp.asarray(token, jnp.int32), jnp.asarray(chunk, jnp.int32),
                             jnp.asarray(tag, jnp.int32)])
