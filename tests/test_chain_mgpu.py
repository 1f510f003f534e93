"""The decode chain megakernel (`pallas_kernels.chain`): its decomposition covers every
weight tile once and every LL word it reads is written once, its sm90 lowering carries the
LL protocol and no fence, its reference is the chain's math, and on an sm90 GPU the kernel
matches the reference."""
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import experiment, lowered_for_sm90

from pallas_kernels._mgpu import on_sm90
from pallas_kernels.chain import attention as ca
from pallas_kernels.chain import call as cc
from pallas_kernels.chain import kernel as cm
from pallas_kernels.chain import plan
from pallas_kernels.chain import resolve as cr
from pallas_kernels.chain import xla as cx

ON_SM90 = jax.default_backend() == "gpu" and on_sm90()
SHAPES = {"350m": (1024, 3072, 2816), "1b": (2048, 6144, 5632)}


@pytest.mark.parametrize("preset", list(SHAPES))
@pytest.mark.parametrize("blocks", [132, 7])
def test_every_weight_tile_is_read_once(preset, blocks):
    D, N1, F = SHAPES[preset]
    for p in plan.products(D, N1, F, blocks):
        seen = np.zeros((p.tiles, p.chunks), int)
        pieces = np.zeros((p.tiles, p.split.sk), int)
        for b, t0, t1, k0, k1 in plan.schedule(D, N1, F, blocks)[p.name]:
            seen[t0:t1, k0:k1] += 1
            pieces[t0:t1, b // p.split.st] += 1
            assert k1 - k0 <= p.kmax()
        assert (seen == 1).all(), p.name
        assert (pieces == 1).all(), p.name  # each tile: one piece per chunk group, sk in all


def test_splits_keep_the_busiest_block_near_the_mean():
    D, N1, F = SHAPES["1b"]
    for p in plan.products(D, N1, F, 132):
        busiest = max((t1 - t0) * (k1 - k0) for _, t0, t1, k0, k1 in plan.schedule(D, N1, F, 132)[p.name])
        assert busiest <= 1.1 * p.tiles * p.chunks / 132 + 1, (p.name, busiest)


def test_layout_regions_do_not_overlap():
    D, N1, F = SHAPES["350m"]
    prods = plan.products(D, N1, F, 132)
    lay = plan.layout(prods, D)
    spans = sorted((lay.offsets[p.name], p.tiles * p.split.sk * plan.T) for p in prods)
    spans += [(lay.offsets["X"], D), (lay.offsets["H"], D), (lay.offsets["Xss"], D // plan.SS),
              (lay.offsets["Hss"], D // plan.SS)]
    spans.sort()
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        assert a + n <= b
    assert spans[-1][0] + spans[-1][1] == lay.layer_words
    words = plan.init_words(jnp.arange(D, dtype=jnp.float32), prods, lay).reshape(-1, 2)
    assert words.shape[0] == lay.init_words and (np.asarray(words[:, 1]) == 1).all()
    x0 = jax.lax.bitcast_convert_type(words[lay.init_H:lay.init_ss, 0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(x0), np.arange(D))
    ss = jax.lax.bitcast_convert_type(words[lay.init_ss:, 0], jnp.float32)  # x_0's square sums
    np.testing.assert_allclose(np.asarray(ss), (np.arange(D, dtype=np.float64).reshape(-1, plan.SS) ** 2).sum(1),
                               rtol=1e-6)
    assert (np.asarray(words[:lay.init_H, 0]) == 0).all()


def test_poll_cost_fit_matches_the_measured_points():
    measured = {1: 0.23, 2: 0.48, 3: 0.59, 8: 1.00, 16: 1.34, 32: 1.64, 64: 2.09}
    for d, us in measured.items():
        assert abs(plan.poll_us(d) - us) < 0.25, (d, plan.poll_us(d), us)


def test_prediction_is_the_documented_one():
    """benchmarks/decode.md quotes the cost model: 11.9 us a layer at 350m, 31.6 at 1b."""
    assert round(plan.predict_us_per_layer(*SHAPES["350m"], 132), 1) == 11.9
    assert round(plan.predict_us_per_layer(*SHAPES["1b"], 132), 1) == 31.6


def inputs(D, N1, F, L, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / shape[-1] ** 0.5).astype(jnp.bfloat16)

    return (jax.random.normal(ks[0], (D,), jnp.float32), w(ks[1], (L, N1, D)), w(ks[2], (L, D, D)),
            w(ks[3], (L, 2 * F, D)), w(ks[4], (L, D, F)))


def test_reference_is_the_chain():
    x0, wq, wo, wgu, wd = inputs(64, 192, 128, 2)
    got = np.asarray(cx.reference(x0, wq, wo, wgu, wd), np.float64)
    x = np.asarray(x0, np.float64)
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    bf = lambda v: f64(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16))  # noqa: E731
    for l in range(2):
        a = f64(wq[l]) @ bf(x)
        h = x + f64(wo[l]) @ bf(a[:64])
        g = f64(wgu[l]) @ bf(h)
        x = h + f64(wd[l]) @ bf(g[:128] / (1 + np.exp(-g[:128])) * g[128:])
    np.testing.assert_allclose(got, x, rtol=2e-2, atol=2e-2 * np.abs(x).max())


@pytest.mark.parametrize("preset,norm_eps,tiles,sums,packed", [
    ("350m", None, 1, False, False), ("1b", 1e-5, 1, False, False), ("1b", 1e-5, 4, False, False),
    ("1b", 1e-5, 1, True, False), ("1b", 1e-5, 4, True, True)])
def test_lowers_for_sm90_with_no_fence(preset, norm_eps, tiles, sums, packed):
    """tiles > 1: the tiles' pieces leave in one LL row store (labels LLH_), whose lanes past
    the group's count store nothing (the count a register operand); tiles=1: a store a tile.
    sums: the dense vectors' writers also store their warps' square sums (lane 0 of a warp,
    after a butterfly sum) and the norms' readers add up square sums (their first words
    only) instead of squaring the vector. packed: the pieces' stores round and pack two values
    a word (a 64-bit shared load a lane) and their readers take the tag's 16 bits and both
    values apart, a lane pair sharing the words."""
    D, N1, F = SHAPES[preset]
    S = jax.ShapeDtypeStruct
    args = (S((D,), jnp.float32), S((2, N1, D), jnp.bfloat16), S((2, D, D), jnp.bfloat16),
            S((2, 2 * F, D), jnp.bfloat16), S((2, D, F), jnp.bfloat16))
    text = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=norm_eps, tiles=tiles,
                                                     norm_sums=sums, packed=packed), *args)
    per_tile = 32 if packed else 64  # words a tile's piece: more than 128 a store take a lane two passes
    assert ("LLH_1:" in text) == (tiles * per_tile > 128) and ("setp.lt.u32 p, e, $5" in text) == (tiles > 1)
    assert ("shfl.sync.bfly.b32 qr, qr, 16" in text) == sums and ("@qy st.relaxed.gpu.global.b64" in text) == sums
    assert ("@nz0 add.f32 s2, s2, x2" in text) == sums  # the readers' square sums
    assert ("ld.shared.v2.b32 {a, b}" in text) == packed and ("and.b32 pt, pt, 65535" in text) == packed
    # a lane pair shares a packed group's words (the odd lane's address a word further) and swaps sums
    assert ("add.s64 sa0_0, a0_0, p256" in text) == packed and ("shfl.sync.bfly.b32 xb, xb, 1" in text) == packed
    squares = "fma.rn.f32 s2" if not sums else "@nz0 add.f32 s2"
    assert (squares in text) == (norm_eps is not None)  # the norms' sums of squares, polled
    assert ("bar.sync" in text.split(squares)[-1][:2000]) == (norm_eps is not None)  # in the poll
    assert ("rsqrt.approx.f32" in text) == (norm_eps is not None)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 and "decode_chain" in text
    for s in ("st.relaxed.gpu.global.b64", "ld.relaxed.gpu.global.b64", "LAB_G", "cvt.rn.bf16.f32",
              "ex2.approx.f32", "trap;"):  # trap: a poll that never ends fails instead of hanging
        assert s in text, s
    for s in ("fence.acq", "fence.proxy.async.global", "red.release"):
        assert s not in text, s
    assert_polls_are_the_warps(text)


def assert_polls_are_the_warps(text):
    """Every poll loop branches back as a warp (`_mgpu.warp_retry`: a vote, then a uniform
    branch), never lane by lane: ptxas serialises every wgmma of a kernel whose poll loops
    diverge (C7520; `experiments/chain_spills.py --aot` shows it)."""
    assert "@bad bra.uni LAB_G" in text and "@p bra.uni LAB_W" in text, "the polls' warp branches"
    assert "vote.sync.any.pred bad, bad, -1" in text
    for divergent in ("@p bra LAB_G", "@p bra LAB_W"):
        assert divergent not in text, divergent


# (D, F, query heads, kv heads, head_dim): the presets' multi-head attention, Llama-3.2-1B's
# grouped-query attention (4 query heads a kv head), 8 a kv head at head_dim 128
ATTENTION = {"350m": (1024, 2816, 16, 16, 64), "1b": (2048, 5632, 16, 16, 128),
             "llama3.2-1b": (2048, 8192, 32, 8, 64), "gqa8-hd128": (1024, 2048, 8, 1, 128),
             "draft-1024": (1024, 2688, 16, 16, 64)}  # `lm.draft_config(width=1024)`'s


def attention_specs(shape: str):
    """The kernel's inputs with attention as shapes (`lowered_for_sm90`): two layers of
    `ATTENTION[shape]`, a cache of 320 positions, one position, the angles of one."""
    D, F, NQ, K, hd = ATTENTION[shape]
    N1 = D + 2 * K * hd
    S = jax.ShapeDtypeStruct
    return (S((D,), jnp.float32), S((2, N1, D), jnp.bfloat16), S((2, D, D), jnp.bfloat16),
            S((2, 2 * F, D), jnp.bfloat16), S((2, D, F), jnp.bfloat16),
            S((2, 2, K, 320, hd), jnp.bfloat16), S((1,), jnp.int32), S((hd,), jnp.float32))


@pytest.mark.parametrize("shape,norm_eps,group", [("350m", None, None), ("1b", 1e-5, None),
                                                  ("llama3.2-1b", 1e-5, None), ("llama3.2-1b", 1e-5, 4),
                                                  ("gqa8-hd128", 1e-5, None)])
def test_attention_lowers_for_sm90_with_no_fence(shape, norm_eps, group):
    """With the attention phase: its RoPE, softmax and combine words and the transposed V
    operand lower, still without a fence; with grouped-query attention each block rotates,
    scores and combines its group's query heads (labels a head) and stores their outputs."""
    D, F, NQ, K, hd = ATTENTION[shape]
    N1 = D + 2 * K * hd
    args = attention_specs(shape)
    text = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=norm_eps, group=group), *args)
    group = cr.attention_group(D, N1, F, 132, hd, K, group)  # chain_mgpu's
    for s in ("ROPE_K", f"ROPE_Q{group - 1}", f"SMAX_L{group - 1}", f"SP_L{group - 1}", "CMB_E",
              "LLH_0", "cvt.f32.bf16", "st.global.b16", "LAB_G"):
        assert s in text, s
    assert f"ROPE_Q{group}:" not in text
    for s in ("fence.acq", "fence.proxy.async.global", "red.release"):
        assert s not in text, s
    assert_polls_are_the_warps(text)


@pytest.mark.parametrize("shape,splits", [("350m", 4), ("gqa8-hd128", 3), ("350m", 8), ("llama3.2-1b", 4)])
def test_split_attention_lowers_and_bad_splits_are_refused(shape, splits):
    """att_splits: each query group's positions over several blocks, each storing its output
    and its log2-sum-exp (lg2), o's readers weighting them (ex2 of the differences, one
    division): it lowers without a fence and polls as a warp (with the long caches' defaults,
    `megakernel.att_splits_for`: 350m 8, Llama-3.2-1B 4); 0, 9 and splits without attention
    are refused, naming the field."""
    args = attention_specs(shape)
    text = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5, att_splits=splits), *args)
    for s in ("lg2.approx.f32", "mov.f32 mn, 0f00000000", "div.rn.f32", "CMB_E", "LAB_G"):
        assert s in text, s
    for s in ("fence.acq", "fence.proxy.async.global", "red.release"):
        assert s not in text, s
    assert_polls_are_the_warps(text)
    plain = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5), *args)
    assert "lg2.approx.f32" not in plain and "mov.f32 mn," not in plain
    for bad in (0, 9):
        with pytest.raises(ValueError, match="att_splits"):
            jax.eval_shape(lambda *a, bad=bad: cc.chain_mgpu(*a, blocks=132, att_splits=bad), *args)
    with pytest.raises(ValueError, match="att_splits"):
        jax.eval_shape(lambda *a: cc.chain_mgpu(*a, blocks=132, att_splits=2), *args[:5])


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 8])
def test_splits_cover_the_positions_and_the_last_owns_the_new_token(splits):
    """`attention.split_tiles`: a head's position tiles split over its blocks cover every tile
    once, in order, the busiest with at most one tile more than the least, and the last
    split, which takes the new token, always has the tile of its position."""
    for n in range(1, 40):
        got = [ca.split_tiles(n, s, splits) for s in range(splits)]
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(got[:-1], got[1:], strict=True))
        sizes = [t1 - t0 for t0, t1 in got]
        assert max(sizes) - min(sizes) <= 1 and sizes[-1] >= 1
        assert sum(ca.items(64 * n, 128, s, splits) for s in range(splits)) == ca.items(64 * n, 128)


@pytest.mark.parametrize("vocab", [256, 128256])
def test_the_output_layer_lowers_inside_the_kernel(vocab):
    """w_head: the kernel with the output layer passes Mosaic GPU's checks for sm90 (the
    table's tiles through the ring, z's TMA stores) and gives z [sk, V] fp32, sk as
    `plan.head_product` chooses; a table whose rows are not whole tiles is refused."""
    D = ATTENTION["llama3.2-1b"][0]
    args = attention_specs("llama3.2-1b")
    head = jax.ShapeDtypeStruct((vocab, D), jnp.bfloat16)
    out = jax.eval_shape(lambda *a: cc.chain_mgpu(*a[:-1], blocks=132, norm_eps=1e-5, w_head=a[-1]), *args, head)
    assert out[2].shape == (plan.head_product(vocab, D, 132).split.sk, vocab) and out[2].dtype == jnp.float32
    text = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a[:-1], blocks=132, norm_eps=1e-5, w_head=a[-1]),
                            *args, head)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert_polls_are_the_warps(text)
    with pytest.raises(ValueError, match="w_head"):
        cc.chain_mgpu(*inputs(128, 192, 128, 1), w_head=jnp.zeros((100, 128), jnp.bfloat16))


def test_capped_loads_lower_and_a_bad_cap_is_refused():
    """loads=N: the producer waits for the tile N steps back to land before it asks for the
    next (an mbarrier wait more in its loop), which passes Mosaic GPU's checks for sm90 and
    changes the kernel; a cap of the ring's stages or more, or below 0, is refused."""
    args = attention_specs("350m")
    lower = lambda loads: lowered_for_sm90(  # noqa: E731
        lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5, loads=loads), *args)
    capped, free = lower(4), lower(0)
    assert capped.count("stablehlo.custom_call @mosaic_gpu") == 1 and capped != free
    assert lower(None) == lower(plan.default_loads(1024)) != free  # the default: d 1024's cap
    for bad in (-1, 16):
        with pytest.raises(ValueError, match=f"loads={bad}: want 0"):
            cc.chain_mgpu(*inputs(128, 192, 128, 1), loads=bad)
    # the attention blocks' own cap: another kernel; as the others' it is the same one
    att = lambda n: lowered_for_sm90(  # noqa: E731
        lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5, att_loads=n), *args)
    assert att(0) != lower(None) == att(plan.default_loads(1024))
    with pytest.raises(ValueError, match="att_loads=16: want None"):
        cc.chain_mgpu(*inputs(128, 192, 128, 1), att_loads=16)


def test_loads_default_to_the_cap_measured_for_the_width():
    """loads=None (chain_mgpu's default) resolves to `plan.default_loads` of the width; a
    ring too short to hold that many tiles makes it 0 (the cap would cap nothing); a given
    cap, 0 included, is kept."""
    x = inputs(128, 192, 128, 1)
    loads = lambda **kw: cr.resolve(*x, None, None, None, cr.Schedule(**kw), blocks=132).sched.loads  # noqa: E731
    assert loads() == plan.default_loads(128) == 2
    assert loads(stages=2) == 0
    assert loads(loads=5) == 5 and loads(loads=0) == 0
    assert plan.default_loads(1024) == 2 and plan.default_loads(2048) == plan.default_loads(4096) == 6


@pytest.mark.parametrize("embed", [False, True])
def test_a_kept_state_lowers_with_the_cache_and_words_in_place(embed):
    """state=...: the kernel takes its words from the call before and the cache, and gives
    both back written in place (outputs aliased to those inputs), the last block out
    advancing the epoch with one acquire-release add; still no fence. embed: x_0 read from
    the token's embedding row (a read-only bf16 load), its words in the state after the LL
    words, and (advance) pos moved on in place too. A state of another size, or one without a
    cache, is refused."""
    args = attention_specs("llama3.2-1b")
    lead = args[:1]
    if embed:
        lead = (jax.ShapeDtypeStruct((128256, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32))
    n = cc.state_size(None if embed else args[0], *args[1:], blocks=132, norm_eps=1e-5,
                      **(dict(embed=lead) if embed else {}))
    splits, spare, _ = plan.tuned(2048, 3072, 8192, 132, 64)
    prods = plan.products(2048, 3072, 8192, 132, attention=True, splits=splits, att_blocks=32 if spare else 0)
    lay = plan.layout(prods, 2048, True, True)
    assert n == plan.state_words(plan.kept_layout(lay) if embed else lay)
    assert n == 2 * plan.REGIONS * lay.layer_words + 2 + (2 * lay.init_words if embed else 0)
    st = jax.ShapeDtypeStruct((n,), jnp.int32)

    def f(*a):
        if embed:
            return cc.chain_mgpu(None, *a[2:-1], blocks=132, norm_eps=1e-5, state=a[-1], embed=a[:2],
                                 advance=True)
        return cc.chain_mgpu(*a[:-1], blocks=132, norm_eps=1e-5, state=a[-1])

    out = jax.eval_shape(f, *lead, *args[1:], st)
    assert [o.shape for o in out] == [(2048,), args[5].shape, (n,)] + [(1,)] * embed
    text = lowered_for_sm90(f, *lead, *args[1:], st)
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d+)", text)
    # kv (input 5), the state (the last input) and with advance pos (input 6)
    assert sorted(int(i) for _, i in aliases) == ([5, 6, 9] if embed else [5, 8])
    assert "atom.acq_rel.gpu.global.add.u32" in text
    assert ("ld.global.nc.b16" in text) == embed
    for s in ("fence.acq", "fence.proxy.async.global", "red.release"):
        assert s not in text, s
    assert_polls_are_the_warps(text)
    with pytest.raises(ValueError, match=f"want int32 \\[{n}\\]"):
        jax.eval_shape(f, *lead, *args[1:], jax.ShapeDtypeStruct((n - 2,), jnp.int32))
    with pytest.raises(ValueError, match="pass kv, pos and rope"):
        cc.chain_mgpu(*inputs(128, 192, 128, 1), state=jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match="advance=True moves pos on"):
        cc.chain_mgpu(*args, blocks=132, advance=True)
    with pytest.raises(ValueError, match="embed=\\(table, token\\) writes x_0's words into the kept state"):
        cc.chain_mgpu(None, *args[1:], blocks=132, embed=lead if embed else (jnp.zeros((8, 2048), jnp.bfloat16),
                                                                             jnp.zeros((1,), jnp.int32)))


@pytest.mark.parametrize("prefetch", [0, 16])
def test_prefetch_asks_l2_for_the_tiles_ahead(prefetch):
    """prefetch=N: the producer asks L2 for weight tiles (`prefetch.global.L2`, 64-bit
    addresses); 0 emits none. A negative count is refused."""
    args = attention_specs("1b")
    text = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5, prefetch=prefetch), *args)
    assert ("prefetch.global.L2" in text) == (prefetch > 0)
    with pytest.raises(ValueError, match="prefetch=-1"):
        cc.chain_mgpu(*inputs(64, 192, 128, 1), prefetch=-1)


@pytest.mark.parametrize("attention", [False, True])
def test_trace_lowers_with_its_points(attention):
    """trace=True: the stamps (timer and clock, a 64-bit store of the pair) and the zeroing
    loop lower, with one more output of [blocks, L, points, 2]; without trace neither."""
    D, N1, F = SHAPES["350m"]
    S = jax.ShapeDtypeStruct
    args = [S((D,), jnp.float32), S((2, N1, D), jnp.bfloat16), S((2, D, D), jnp.bfloat16),
            S((2, 2 * F, D), jnp.bfloat16), S((2, D, F), jnp.bfloat16)]
    if attention:
        args += [S((2, 2, 16, 320, 64), jnp.bfloat16), S((1,), jnp.int32), S((64,), jnp.float32)]
    for trace in (False, True):
        f = lambda *a, trace=trace: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5, trace=trace)  # noqa: E731
        text = lowered_for_sm90(f, *args)
        assert ("%globaltimer" in text) == trace and ("ZW_L" in text) == trace
        if trace:
            out = jax.eval_shape(f, *args)
            assert out[-1].shape == (132, 2, len(cm.TRACE_POINTS), 2)


# words a lane polls a pass for each product's input: the sources' pieces (sk of them, a lane
# pair's half when packed) plus a dense vector (the residual; o's: the attention's output)
POLLED = {("350m", False): dict(qkv=8 + 1, o=1, gu=8 + 1, down=4 + 4),
          ("1b", False): dict(qkv=44 + 1, o=1, gu=8 + 1, down=8 + 8),
          ("1b", True): dict(qkv=22 + 1, o=1, gu=4 + 1, down=4 + 4)}


@pytest.mark.parametrize("preset,packed", list(POLLED))
def test_reads_put_every_input_chunk_in_its_slot_once(preset, packed):
    """The poll rounds the kernel issues (`product_reads`, skipped where the round's first
    chunk is past the block's: as `kernel.gather`) read each of a block's input chunks
    into slot chunk - k0 exactly once, within the words a lane may poll a round; a head's
    (`head_reads`) read q's, k's and v's chunks into stage slots r * nc + j. packed: a lane
    polls half a piece group's words (a lane pair shares them)."""
    D, N1, F = SHAPES[preset]
    prods = plan.products(D, N1, F, 132, attention=True)
    lay = plan.layout(prods, D, attention=True, packed=packed)
    for p in prods:
        groups = plan.input_spec(p.name, 1, 0, prods, lay, F, True, True)[0]
        words = cm.words(groups)
        assert words == POLLED[preset, packed][p.name], p.name
        assert any(g.packed for g in groups) == (packed and p.name != "o")  # o reads the attention's dense words
        for b in range(132):
            active, _, _, k0, k1 = plan.rect(p, b)
            if not active:
                continue
            rounds = [r for r in plan.product_reads(p, k0, k1, words) if r.chunks[0] < k1]
            assert sorted(cs for r in rounds for cs in r.expand()) == [(c, c - k0) for c in range(k0, k1)]
            assert all(r.passes * words <= max(plan.MAX_POLL_WORDS, words) for r in rounds)
    for hd in (64, 128, 256):
        nc = hd // 64
        for h in (0, 5):
            got = sorted(cs for r in plan.head_reads(D, h, hd, 8) for cs in r.expand())
            assert got == sorted((h * nc + r * D // 64 + j, r * nc + j) for r in range(3) for j in range(nc))


def test_split_overrides_are_checked():
    prods = plan.products(1024, 3072, 2816, 132, True, (("down", 22, 6),))
    assert prods[3].split == plan.Split(22, 6) and prods[2].split == plan.products(1024, 3072, 2816, 132)[2].split
    with pytest.raises(ValueError, match="sk <= 44 chunks"):
        plan.products(1024, 3072, 2816, 132, True, (("down", 50, 6),))
    with pytest.raises(ValueError, match="use qkv, o, gu or down"):
        plan.products(1024, 3072, 2816, 132, True, (("mlp", 2, 6),))


@pytest.mark.parametrize("preset,att_blocks", [("350m", 16), ("1b", 16), ("350m", 131)])
def test_o_spares_the_attention_blocks(preset, att_blocks):
    """With att_blocks, o's rectangles lie on the blocks that do not attend (the last
    att_blocks, `attention.head_of`), and still cover every o tile once; the other products
    keep every block."""
    D, N1, F = SHAPES[preset]
    prods = plan.products(D, N1, F, 132, attention=True, att_blocks=att_blocks)
    o = prods[1]
    active = [b for b in range(132) if plan.rect(o, b)[0]]
    assert active and max(active) < 132 - att_blocks
    assert all(ca.head_of(b, 132) >= att_blocks for b in active)
    seen = np.zeros((o.tiles, o.chunks), int)
    for b in active:
        _, t0, t1, k0, k1 = plan.rect(o, b)
        seen[t0:t1, k0:k1] += 1
    assert (seen == 1).all()
    assert prods[2].split == plan.products(D, N1, F, 132, attention=True)[2].split
    with pytest.raises(ValueError, match="att_blocks=132"):
        plan.products(D, N1, F, 132, attention=True, att_blocks=132)
    with pytest.raises(ValueError, match="sk \\* st <= 100 blocks"):
        plan.products(D, N1, F, 132, True, (("o", 8, 16),), att_blocks=32)


@pytest.mark.parametrize("key", list(plan.MEASURED))
def test_measured_choices_fit_their_shape(key):
    """Each measured (splits, spare, group) is a choice `products` takes for its shape (as
    multi-head attention: q|k|v 3 D rows), o within the blocks that do not attend when
    spare; other shapes get the cost model's, o on every block, the default group."""
    D, N1, F, blocks, hd = key
    splits, spare, _ = plan.tuned(*key)
    heads = D // hd // cr.attention_group(D, N1, F, blocks, hd, (N1 - D) // (2 * hd))
    prods = plan.products(D, N1, F, blocks, True, splits, att_blocks=heads if spare else 0)
    named = {n for n, *_ in splits}
    assert {p.name: (p.split.sk, p.split.st) for p in prods if p.name in named} == \
        {n: (sk, st) for n, sk, st in splits}
    assert plan.tuned(D, N1, F, blocks + 1, hd) == ((), False, None)


def test_bad_inputs_name_the_field():
    x0, wq, wo, wgu, wd = inputs(64, 192, 128, 1)
    with pytest.raises(ValueError, match="want"):
        cc.chain_mgpu(x0, wq, wo, wgu[:, :64], wd)
    with pytest.raises(ValueError, match="multiples of 64"):
        cc.chain_mgpu(x0[:32], wq[:, :, :32], wo[:, :32, :32], wgu[:, :, :32], wd[:, :32])
    with pytest.raises(ValueError, match="bf16"):
        cc.chain_mgpu(x0, wq.astype(jnp.float32), wo, wgu, wd)
    with pytest.raises(ValueError, match="stages=40"):
        cc.chain_mgpu(x0, wq, wo, wgu, wd, stages=40, blocks=132)
    with pytest.raises(ValueError, match="tiles=9: want 1 to 8"):
        cc.chain_mgpu(x0, wq, wo, wgu, wd, tiles=9, blocks=132)
    many = [jax.ShapeDtypeStruct((65535, *a.shape[1:]), a.dtype) for a in (wq, wo, wgu, wd)]
    with pytest.raises(ValueError, match="16 bits: 65535 layers"):  # packed words' tags
        jax.eval_shape(lambda *w: cc.chain_mgpu(x0, *w, packed=True, blocks=132), *many)
    kv, pos, rope = attention_inputs(1, 64, 128, 3, heads=1)
    with pytest.raises(ValueError, match="N1=256 equal to D \\+ 2 kv_heads head_dim"):
        cc.chain_mgpu(*inputs(64, 256, 128, 1), kv, pos, rope)
    with pytest.raises(ValueError, match="capacity=100"):
        cc.chain_mgpu(x0, wq, wo, wgu, wd, kv[:, :, :, :100], pos, rope)
    with pytest.raises(ValueError, match="want \\[L=1, 2"):
        cc.chain_mgpu(x0, wq, wo, wgu, wd, kv[0], pos, rope)
    with pytest.raises(ValueError, match="group=3: want a divisor of the 4 query heads"):
        cc.chain_mgpu(*gqa_inputs(512, 64, 2, 128, 1), *attention_inputs(1, 512, 128, 3, heads=8, kv_heads=2),
                      group=3)


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,layers,norms,tiles,sums,packed,inflight", [
    ("350m", 1, False, 1, False, False, 1), ("350m", 3, False, 1, False, False, 1), ("1b", 2, False, 1, False, False, 1),
    ("350m", 2, True, 1, False, False, 1), ("1b", 2, True, 1, False, False, 1), ("350m", 3, False, 2, False, False, 1),
    ("1b", 2, True, 4, False, False, 1), ("350m", 3, True, 1, True, False, 1), ("1b", 2, True, 4, True, False, 1),
    ("350m", 3, False, 1, False, True, 1), ("1b", 2, True, 4, True, True, 1), ("1b", 2, True, 1, True, True, 2),
    ("350m", 3, True, 2, True, True, 3)])
def test_matches_the_reference_on_the_gpu(preset, layers, norms, tiles, sums, packed, inflight):
    """tiles > 1: a block's tile pieces made several at a time, the last group short where
    its tiles do not divide (350m's q|k|v: 3 a block at tiles=2; 1b's gate|up: 11 at 4).
    sums: the norms' readers poll square sums (`norm_sums`); packed: pieces two values a
    word; inflight: more products in flight before a slot is freed."""
    D, N1, F = SHAPES[preset]
    x0, wq, wo, wgu, wd = inputs(D, N1, F, layers)
    if norms:
        g = gains(D, layers)
        wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
        got = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, norm_eps=1e-5, tiles=tiles, norm_sums=sums, packed=packed,
                            inflight=inflight)
        want = cx.reference(x0, wq, wo, wgu, wd, norms=g, eps=1e-5)
    else:
        got = cc.chain_mgpu(x0, wq, wo, wgu, wd, tiles=tiles, packed=packed)
        want = cx.reference(x0, wq, wo, wgu, wd)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("norms", [False, True])
def test_packed_pieces_with_odd_piece_counts_on_the_gpu(norms):
    """packed=True where a piece group's count is odd (gate|up in 3 chunk groups: down's
    readers' last piece is read by both lanes of a pair, counted by the even one) or 1 (o
    in one: gate|up's readers' only word), against the reference."""
    D, N1, F = SHAPES["350m"]
    x0, wq, wo, wgu, wd = inputs(D, N1, F, 2)
    splits = (("gu", 3, 40), ("o", 1, 16))
    g = gains(D, 2) if norms else None
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g) if norms else (wq, wgu)
    got = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, norm_eps=1e-5 if norms else None, splits=splits, packed=True)
    want = cx.reference(x0, wq, wo, wgu, wd, norms=g, eps=1e-5)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def attention_inputs(L, D, capacity, pos, heads=16, kv_heads=None):
    """(kv, pos, rope) as the benchmark builds them (random bf16 cache, the angles of pos);
    kv_heads: the cache's heads (grouped-query attention), heads' head_dim."""
    kv, pos_, rope = experiment("bench_chain_mgpu").attention_inputs(L, D, capacity, pos, heads)[0]
    return (kv if kv_heads is None else kv[:, :, :kv_heads]), pos_, rope


def rope_table_around(rope_hd, pos: int, rows: int):
    """A [rows, hd] table of angles: random rows, but row pos is rope_hd."""
    table = jax.random.uniform(jax.random.key(pos), (rows, rope_hd.shape[0]), jnp.float32, -1, 1)
    return table.at[pos].set(rope_hd)


def test_a_table_of_angles_is_read_at_the_position():
    """The reference reads row pos of a table of angles (clipped to the capacity) as it reads
    the position's angles given alone; another row's angles give another result."""
    x0, wq, wo, wgu, wd = gqa_inputs(128, 64, 1, 64, 1)
    kv, pos, rope = attention_inputs(1, 128, 128, 70, heads=2, kv_heads=1)
    table = rope_table_around(rope, 70, 128)
    want = cx.reference(x0, wq, wo, wgu, wd, kv, pos, rope)
    got = cx.reference(x0, wq, wo, wgu, wd, kv, pos, table)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = cx.reference(x0, wq, wo, wgu, wd, kv, pos, table.at[70].set(table[71]))
    assert not np.array_equal(np.asarray(other[1]), np.asarray(want[1]))
    with pytest.raises(ValueError, match="a table"):
        cc.chain_mgpu(x0, wq, wo, wgu, wd, kv, pos, table[:100])


def gqa_inputs(D, hd, kv_heads, F, L, seed=0):
    """The chain's weights for grouped-query attention: q|k|v [L, D + 2 kv_heads hd, D]."""
    return inputs(D, D + 2 * kv_heads * hd, F, L, seed)


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,options", [
    ("350m", dict(loads=0)), ("350m", dict(loads=4)), ("llama3.2-1b", dict(loads=0)),
    ("llama3.2-1b", dict(loads=2)), ("1b", dict(loads=0)), ("gqa8-hd128", dict(loads=3)),
    ("350m", dict(att_loads=0)), ("llama3.2-1b", dict(att_loads=12))])
def test_scheduling_options_give_the_default_kernels_bits_on_the_gpu(preset, options):
    """loads (how many weight tiles a block has asked for and not yet received; 0: the ring's
    free slots, the kernel before the default cap) and att_loads (the attention blocks' own)
    change when things happen, not what is summed in which order: the output and the new k
    and v are the default kernel's, bit for bit."""
    D, F, NQ, K, hd = ATTENTION[preset]
    x0, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, 3)
    att = attention_inputs(3, D, 320, 129, heads=NQ, kv_heads=K)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *gains(D, 3))
    run = lambda **kw: cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, *att, norm_eps=1e-5, **kw)  # noqa: E731
    for a, b in zip(run(**options), run(), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,layers,norms,pos,tiles,sums,packed,inflight", [
    ("350m", 2, False, 70, 1, False, False, 1), ("350m", 1, False, 0, 1, False, False, 1),
    ("350m", 5, True, 255, 1, False, False, 1), ("1b", 3, True, 129, 1, False, False, 1),
    ("llama3.2-1b", 3, True, 129, 1, False, False, 1), ("llama3.2-1b", 2, True, 0, 1, False, False, 1),
    ("gqa8-hd128", 3, True, 200, 1, False, False, 1), ("llama3.2-1b", 2, True, "table", 1, False, False, 1),
    ("1b", 2, True, 129, 4, False, False, 1), ("llama3.2-1b", 2, True, 129, 3, False, False, 1),
    ("1b", 3, True, 129, 1, True, False, 1), ("llama3.2-1b", 2, True, 0, 1, True, False, 1),
    ("gqa8-hd128", 3, True, 200, 1, True, False, 1), ("1b", 3, True, 129, 1, False, True, 1),
    ("llama3.2-1b", 2, True, 0, 1, True, True, 1), ("llama3.2-1b", 2, True, 129, 1, True, True, 2),
    ("1b", 3, True, 129, 2, True, True, 3)])
def test_attention_matches_the_reference_on_the_gpu(preset, layers, norms, pos, tiles, sums, packed, inflight):
    """pos "table": the angles as a table of every position's (random rows but row 129, the
    new token's): the kernel reads its position's row. tiles, sums, packed, inflight: as in the test
    above."""
    D, F, NQ, K, hd = ATTENTION[preset]
    x0, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, layers)
    att = attention_inputs(layers, D, 320, 129 if pos == "table" else pos, heads=NQ, kv_heads=K)
    if pos == "table":
        att = (*att[:2], rope_table_around(att[2], 129, 320))
    g = gains(D, layers) if norms else None
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g) if norms else (wq, wgu)
    got, got_kv = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, *att, norm_eps=1e-5 if norms else None,
                                tiles=tiles, norm_sums=sums, packed=packed, inflight=inflight)
    want, want_kv = cx.reference(x0, wq, wo, wgu, wd, *att, norms=g, eps=1e-5)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    got_kv, want_kv = np.asarray(got_kv, np.float32), np.asarray(want_kv, np.float32)
    assert np.linalg.norm(got_kv - want_kv) <= 1e-2 * np.linalg.norm(want_kv)


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,capacity,pos,splits", [
    ("350m", 320, 0, 4), ("350m", 320, 70, 4), ("350m", 320, 255, 2), ("350m", 2048, 1990, 8),
    ("1b", 320, 129, 3), ("llama3.2-1b", 320, 129, 2), ("llama3.2-1b", 2048, 2000, 4), ("gqa8-hd128", 320, 200, 4)])
def test_split_attention_matches_the_reference_on_the_gpu(preset, capacity, pos, splits):
    """att_splits: each query group's positions over `splits` blocks (at pos 0 and 70 some
    have none), merged by o's readers: x_L and the new k, v within bf16's error of the
    reference's; layer 0's new k and v bit for bit the kernel's without splits (later layers'
    follow an attention merged in another order, so their bf16 rounding may differ)."""
    D, F, NQ, K, hd = ATTENTION[preset]
    x0, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, 3)
    att = attention_inputs(3, D, capacity, pos, heads=NQ, kv_heads=K)
    g = gains(D, 3)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
    got, got_kv = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, *att, norm_eps=1e-5, att_splits=splits)
    _, plain_kv = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, *att, norm_eps=1e-5)
    want, want_kv = cx.reference(x0, wq, wo, wgu, wd, *att, norms=g, eps=1e-5)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    got_kv, want_kv = np.asarray(got_kv, np.float32), np.asarray(want_kv, np.float32)
    assert np.linalg.norm(got_kv - want_kv) <= 1e-2 * np.linalg.norm(want_kv)
    np.testing.assert_array_equal(got_kv[0], np.asarray(plain_kv, np.float32)[0])


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
def test_split_attention_with_a_kept_state_on_the_gpu():
    """att_splits with the decode loop's form (state, embed, advance): calls at 1990, 1991
    and 1990 again give the bits of fresh-word calls with the same splits, the cache with
    the new k and v written once at the position."""
    D, F, NQ, K, hd = ATTENTION["llama3.2-1b"]
    _, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, 2)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *gains(D, 2))
    kv, _, rope = attention_inputs(2, D, 2048, 1990, heads=NQ, kv_heads=K)
    angles = rope_table_around(rope, 1990, 2048)
    emb = jax.random.normal(jax.random.key(9), (1000, D), jnp.float32).astype(jnp.bfloat16)
    opts = dict(norm_eps=1e-5, att_splits=4)
    f = jax.jit(lambda token, kv, pos, state: cc.chain_mgpu(None, wq_f, wo, wgu_f, wd, kv, pos, angles, state=state,
                                                            embed=(emb, token), advance=True, **opts))
    fresh = jax.jit(lambda x, kv, pos: cc.chain_mgpu(x, wq_f, wo, wgu_f, wd, kv, pos, angles, **opts))
    one = jnp.zeros((1,), jnp.int32)
    state = jnp.zeros((cc.state_size(None, wq_f, wo, wgu_f, wd, kv, one, angles, embed=(emb, one), **opts),),
                      jnp.int32)
    for i, p in enumerate((1990, 1991, 1990)):
        token = jnp.array([7 + 300 * i], jnp.int32)
        pos = jnp.array([p], jnp.int32)
        want_x, kv_new = fresh(emb[token[0]].astype(jnp.float32), kv, pos)
        got_x, got_kv, state, pos_next = f(token, kv, pos, state)
        assert int(pos_next[0]) == p + 1
        np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5,
                                   atol=1e-5 * np.abs(np.asarray(want_x)).max())
        want_kv = jax.lax.dynamic_update_slice(kv, kv_new[:, :, :, None], (0, 0, 0, p, 0))
        np.testing.assert_array_equal(np.asarray(got_kv, np.float32), np.asarray(want_kv, np.float32))
        kv = got_kv


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,vocab,attention", [("350m", 256, False), ("1b", 32000, True),
                                                    ("llama3.2-1b", 128256, True)])
def test_the_output_layer_inside_matches_the_reference_on_the_gpu(preset, vocab, attention):
    """w_head: the pieces' sum is the table (gain folded) times bf16(x_L), within bf16's
    error of the reference's, and x_L and the new k, v are what they are without it."""
    D, F, NQ, K, hd = ATTENTION[preset]
    x0, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, 2)
    g = gains(D, 2)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
    table = cx.fold_head(jax.random.normal(jax.random.key(7), (vocab, D), jnp.float32).astype(jnp.bfloat16),
                         g[0][0])
    att = attention_inputs(2, D, 320, 129, heads=NQ, kv_heads=K) if attention else ()
    got = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, *att, norm_eps=1e-5, w_head=table)
    plain = cc.chain_mgpu(x0, wq_f, wo, wgu_f, wd, *att, norm_eps=1e-5)
    want = cx.reference(x0, wq, wo, wgu, wd, *att, norms=g, eps=1e-5, w_head=table)
    z, want_z = np.asarray(got[-1], np.float64).sum(axis=0), np.asarray(want[-1][0], np.float64)
    assert np.linalg.norm(z - want_z) <= 1e-2 * np.linalg.norm(want_z)
    plain = plain if attention else (plain,)
    for a, b in zip(got[:-1], plain, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,head,embed", [("llama3.2-1b", True, False), ("350m", False, False),
                                               ("llama3.2-1b", True, True), ("1b", False, True)])
def test_a_kept_state_matches_fresh_words_on_the_gpu(preset, head, embed):
    """Calls one after another on one state (positions 129, 130, then 129 again: a rollback)
    give the bits of calls with fresh words, the cache each time that with the new k and v
    written at the position, and the epoch counts the calls (its count back at 0). embed:
    x_0 is a token's row the kernel reads (its square sums summed in another order than
    XLA's: within 1e-5), and the kernel moves the position on (advance)."""
    D, F, NQ, K, hd = ATTENTION[preset]
    x0, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, 2)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *gains(D, 2))
    kv, _, rope = attention_inputs(2, D, 320, 129, heads=NQ, kv_heads=K)
    angles = rope_table_around(rope, 129, 320)
    extra = dict(w_head=cx.fold_head(jax.random.normal(jax.random.key(7), (4096, D)).astype(jnp.bfloat16),
                                     jnp.ones((D,)))) if head else {}
    f = jax.jit(lambda x, kv, pos, state: cc.chain_mgpu(x, wq_f, wo, wgu_f, wd, kv, pos, angles, norm_eps=1e-5,
                                                        state=state, **extra))
    fresh = jax.jit(lambda x, kv, pos: cc.chain_mgpu(x, wq_f, wo, wgu_f, wd, kv, pos, angles, norm_eps=1e-5,
                                                     **extra))
    state = jnp.zeros((cc.state_size(x0, wq_f, wo, wgu_f, wd, kv, jnp.zeros((1,), jnp.int32), angles,
                                     norm_eps=1e-5, **extra),), jnp.int32)
    emb = jax.random.normal(jax.random.key(9), (1000, D), jnp.float32).astype(jnp.bfloat16)
    if embed:
        f = jax.jit(lambda token, kv, pos, state: cc.chain_mgpu(None, wq_f, wo, wgu_f, wd, kv, pos, angles,
                                                                norm_eps=1e-5, state=state,
                                                                embed=(emb, token), advance=True, **extra))
        state = jnp.zeros((cc.state_size(None, wq_f, wo, wgu_f, wd, kv, jnp.zeros((1,), jnp.int32), angles,
                                         norm_eps=1e-5, embed=(emb, jnp.zeros((1,), jnp.int32)),
                                         **extra),), jnp.int32)
    same = (lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())) if embed else (
        np.testing.assert_array_equal)
    for i, p in enumerate((129, 130, 129)):
        token = jnp.array([7 + 300 * i], jnp.int32)
        x = emb[token[0]].astype(jnp.float32) if embed else x0 * (1 + 0.1 * i)
        pos = jnp.array([p], jnp.int32)
        want_x, kv_new, *want_z = fresh(x, kv, pos)
        got_x, got_kv, *got_z, state = f(token if embed else x, kv, pos, state)
        if embed:  # advance: the position moved on
            *got_z, state, pos_next = (*got_z, state)
            assert int(pos_next[0]) == p + 1
        same(np.asarray(got_x), np.asarray(want_x))
        for a, b in zip(got_z, want_z, strict=True):
            same(np.asarray(a), np.asarray(b))
        want_kv = jax.lax.dynamic_update_slice(kv, kv_new[:, :, :, None], (0, 0, 0, p, 0))
        same(np.asarray(got_kv, np.float32), np.asarray(want_kv, np.float32))
        kv = got_kv
        assert int(state[-2]) == i + 1 and int(state[-1]) == 0


def unpack(pairs):
    """The values and tags of packed LL words (int32 pairs [n, 2]) as the kernel's readers
    take them apart (`words.gather`): [n, 2] float64 and [n]."""
    w = np.asarray(pairs).astype(np.uint32).astype(np.uint64)
    w = w[:, 0] | (w[:, 1] << np.uint64(32))
    top = np.stack([(w >> np.uint64(16 + 24 * i)) & np.uint64(0xFFFFFF) for i in range(2)], axis=1)
    vals = (top.astype(np.uint32) << np.uint32(8)).view(np.float32).astype(np.float64)
    return vals, (w & np.uint64(0xFFFF)).astype(int)


def test_packed_words_keep_two_values_and_a_tag():
    """`plan.pack`: two fp32 values rounded to 24 bits (2^-16 relative) and a 16-bit tag in
    one 64-bit word; the readers' unpacking gives them back."""
    v = np.asarray(jax.random.normal(jax.random.key(3), (1000, 2), jnp.float32)) * 10.0 ** np.arange(-3, 3).repeat(334)[:1000, None]
    vals, tags = unpack(plan.pack(v, 77))
    np.testing.assert_allclose(vals, v, rtol=2 ** -16)
    assert not np.array_equal(vals, v) and (tags == 77).all()
    vals, tags = unpack(plan.pack(np.zeros((3, 2)), 1))
    assert (vals == 0).all() and (tags == 1).all()


def emulate(x0, wq, wo, wgu, wd, blocks, norm_eps=None, att=None, splits=(), att_blocks=0, group=None,
            sums=False, packed=False, w_head=None, state=None, embed=False, att_splits=1):
    """The kernel's data flow in numpy, through the kernel's own decomposition (`rect`), word
    layout (`layout`, `init_words`, `piece_word`) and input wiring (`input_spec`): each
    active block gathers its chunks (summing pieces, the residual, SwiGLU), rounds them to
    bf16, writes one piece per tile, and the tile-group-0 readers write the dense residuals.
    Every word read must carry the tag its group expects (the layer that wrote it), and a
    word is only overwritten two layers later (two regions, `plan.tag`). att: (kv, pos, rope) as `chain_mgpu`
    takes them: each attention block reads its query heads' q and their kv head's k, v
    through `input_spec("att")` and `head_reads` into its stage slots, attends in numpy
    (`attend`) and writes the layer's "att" words, which o reads. sums: the RMSNorms' readers
    read the dense writers' square sums (`chain_mgpu(norm_sums=True)`). packed: pieces two
    values a word, each rounded as `plan.pack` rounds it (`chain_mgpu(packed=True)`). Returns
    x_L (and kv_new). w_head [V, D]: then also z [sk, V], the output layer's pieces as the
    kernel's blocks make them (`plan.head_product`'s rectangles over x_L's chunks read as
    the final chunks are), each written once. state: a dict of the LL words' values and tags
    and the epoch, kept from one call to the next (`chain_mgpu(state=...)`, empty before the
    first): words are tagged with the call's epoch, a word may be overwritten only when it
    holds the call before's (or nothing, or its own two layers back), and the epoch advances.
    embed (with a state): the host's words lie in the state after the LL words
    (`plan.kept_layout`), x_0's and its square sums written at the call's start with its
    tag, the down pieces the zeros the state began with (`chain_mgpu(embed=...)`). att_splits
    R > 1: each query group's positions split over R blocks (`attention.split_tiles`), each
    writing its normalised output and log2-sum-exp, which o's readers merge."""
    L, N1, D = wq.shape
    F = wd.shape[2]
    new = []
    prods = plan.products(D, N1, F, blocks, attention=att is not None, splits=splits,
                          att_blocks=att_blocks)
    lay = plan.layout(prods, D, attention=att is not None, packed=packed, att_splits=att_splits)
    assert lay.packed == packed and lay.piece_words == (32 if packed else 64)
    epoch = state.setdefault("epoch", 0) if state is not None else 0
    tag = lambda l: plan.tag(l, epoch)  # noqa: E731
    init = np.asarray(plan.init_words(x0, prods, lay, epoch)).reshape(-1, 2)
    assert init.shape[0] == lay.init_words
    init_vals = np.zeros((lay.init_words, 2))  # a word's values (the second: packed words')
    init_vals[:, 0] = init[:, 0].view(np.float32)
    init_tags = init[:, 1].copy()
    if packed:  # the down pieces
        init_vals[:lay.init_H], init_tags[:lay.init_H] = unpack(init[:lay.init_H])
    n_words = plan.REGIONS * lay.layer_words
    if embed:  # the host's words in the state: the kernel writes x_0's, the down pieces stay 0
        assert state is not None
        lay = plan.kept_layout(lay)
        n_words += lay.init_words
    vals = np.zeros((n_words, 2))
    use_sums = sums
    tags = np.zeros(n_words, int)
    if state is not None:  # the words of the calls before
        vals, tags = state.setdefault("vals", vals), state.setdefault("tags", tags)
    if embed:  # read where the LL words are read (`init_ref` is the state)
        init_vals, init_tags = vals, tags
        x = np.asarray(x0, np.float32)
        for w0, words_ in ((lay.init_H, x), (lay.init_ss, (x.reshape(-1, plan.SS) ** 2).sum(axis=1))):
            assert (tags[w0:w0 + words_.size] != tag(-1)).all()  # none a reader could take early
            vals[w0:w0 + words_.size, 0], tags[w0:w0 + words_.size] = words_, tag(-1)

    def write(w0, n, values, l, two=False):
        """n values from word w0 (two: two a word, rounded as the kernel's packed words)."""
        k = n // 2 if two else n
        old = tags[w0:w0 + k]
        before = (old - 2) // 256 == (epoch - 1) % plan.EPOCHS  # the call before's (its epoch's)
        assert (np.isin(old, [0, tag(l) - plan.REGIONS]) | before).all(), (w0, l)  # not too early
        assert (old != tag(l)).all(), (w0, l)  # nor a word a reader polling early would take
        if two:
            vals[w0:w0 + k] = unpack(plan.pack(np.asarray(values, np.float32).reshape(-1, 2), tag(l)))[0]
        else:
            vals[w0:w0 + k, 0] = values
        tags[w0:w0 + k] = tag(l)
    W = {"qkv": wq, "o": wo, "gu": wgu, "down": wd}
    W = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in W.items()}
    bf16 = lambda v: np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa: E731

    def words(base_word, n, init_ok, use_init, want, two=False):
        """n values from word base_word (two: two a word)."""
        w0, k = int(base_word), n // 2 if two else n
        src_tags, src = (init_tags, init_vals) if init_ok and use_init else (tags, vals)
        assert (src_tags[w0:w0 + k] == int(want)).all(), (w0, n, want)
        return src[w0:w0 + k].reshape(-1) if two else src[w0:w0 + k, 0]

    def read(name, l, gt, c, use_init):
        groups, dense, norm = plan.input_spec(name, l, gt, prods, lay, F, norm_eps is not None,
                                              att is not None, use_sums, epoch, att_splits)
        sums = [np.zeros(64), np.zeros(64)]
        if any(g.lse for g in groups):  # the splits' outputs, weighted by their log2-sum-exps
            (vals_, lse_) = ([words(int(g.base_word) + c * g.stride + j * 64, 64, False, False, g.tag)
                              for j in range(g.count)] for g in groups)
            assert all((x == x[0]).all() for x in lse_)  # one a split, at every column
            w = np.exp2(np.array(lse_) - np.max(lse_, axis=0))
            return (w * np.array(vals_)).sum(axis=0) / w.sum(axis=0)
        for count, stride, is_b, base_word, init_ok, want, two, _ in groups:
            for j in range(count):
                sums[is_b] += words(int(base_word) + c * stride + j * (32 if two else 64), 64, init_ok, use_init,
                                    want, two)
        if dense and bool(dense["dense_on"]):
            assert int(dense["dense_tag"]) == tag(l)
            write(int(dense["dense_base"]) + c * 64, 64, sums[0], l)
            assert ("dense_ss" in dense) == use_sums
            if use_sums:  # a warp's 32 values a word
                write(int(dense["dense_ss"]) + c * 2, 2, (sums[0].reshape(2, plan.SS) ** 2).sum(axis=1), l)
        if norm is not None:
            if use_sums:
                square_sum = words(norm[0], D // plan.SS, norm[1], use_init, norm[2]).sum()
            else:
                v = words(norm[0], D, norm[1], use_init, norm[2])
                square_sum = (v * v).sum()
            sums = [u / np.sqrt(square_sum / D + norm_eps) for u in sums]
        if any(g.is_b for g in groups):
            return sums[0] / (1 + np.exp(-sums[0])) * sums[1]
        return sums[0]

    for l in range(L):
        for p in prods:
            for b in range(blocks):
                active, t0, t1, k0, k1 = plan.rect(p, b)
                if not active:
                    continue
                gk, gt = b // p.split.st, b % p.split.st
                x = {c: bf16(read(p.name, l, gt, c, l == 0)) for c in range(k0, k1)}
                for t in range(t0, t1):
                    piece = sum(W[p.name][l, t * 64:(t + 1) * 64, c * 64:(c + 1) * 64] @ x[c]
                                for c in range(k0, k1))
                    write(plan.piece_word(p, l, t, gk, lay), 64, piece, l, two=packed)
            if p.name == "qkv" and att is not None:
                kv, pos, rope = (np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a) for a in att)
                H, hd = kv.shape[2], kv.shape[4]
                nc, NQ = hd // 64, D // hd
                GB = group or ca.group_of(NQ, H)
                R = att_splits
                for a, split in itertools.product(range(NQ // GB), range(R)):  # query heads a GB .., a split
                    j = a * GB // (NQ // H)  # their kv head
                    words_ = cm.words(plan.input_spec("att", l, 0, prods, lay, F, epoch=epoch)[0])
                    slot = {s: read("att", l, 0, c, l == 0)
                            for r in plan.head_reads(D, a, hd, words_, H, GB) for c, s in r.expand()}
                    assert sorted(slot) == list(range((GB + 2) * nc))
                    stage = np.concatenate([slot[s] for s in range((GB + 2) * nc)])
                    k, v = stage[GB * hd:(GB + 1) * hd], stage[(GB + 1) * hd:]
                    rows = [64 * t for t in ca.split_tiles(int(ca.tiles(int(pos[0]))), split, R)]
                    for g in range(GB):
                        o, lse, kn, vn = attend(stage[g * hd:(g + 1) * hd], k, v, kv[l, 0, j], kv[l, 1, j],
                                                int(pos[0]), rope, bf16, rows, split == R - 1)
                        if R == 1:
                            write(plan.region(l, lay) + lay.offsets["att"] + (a * GB + g) * hd, hd, o, l)
                            continue
                        for c in range(nc):  # o's input chunk (a GB + g) nc + c, this split's 64 words
                            word = (((a * GB + g) * nc + c) * R + split) * 64
                            write(plan.region(l, lay) + lay.offsets["att"] + word, 64, o[c * 64:(c + 1) * 64], l)
                            write(plan.region(l, lay) + lay.offsets["lse"] + word, 64, np.full(64, lse), l)
                    if split == R - 1:
                        new.append((l, j, kn, vn))
    x_L = np.concatenate([read("final", L - 1, 0, c, False) for c in range(D // 64)])
    z = None
    if w_head is not None:
        hp = plan.head_product(w_head.shape[0], D, blocks)
        Wh = np.asarray(w_head.astype(jnp.float32), np.float64)
        z = np.full((hp.split.sk, hp.N), np.nan)
        for b in range(blocks):
            active, t0, t1, k0, k1 = plan.rect(hp, b)
            if not active:
                continue
            x = {c: bf16(read("head", L - 1, 0, c, False)) for c in range(k0, k1)}
            for t in range(t0, t1):
                gk = b // hp.split.st
                assert np.isnan(z[gk, t * 64:(t + 1) * 64]).all()
                z[gk, t * 64:(t + 1) * 64] = sum(Wh[t * 64:(t + 1) * 64, c * 64:(c + 1) * 64] @ x[c]
                                                 for c in range(k0, k1))
        assert not np.isnan(z).any()
    if state is not None:  # the last block out advances the epoch
        state["epoch"] = (epoch + 1) % plan.EPOCHS
    if att is None:
        return x_L if z is None else (x_L, z)
    kv_new = np.zeros((L, 2, att[0].shape[2], att[0].shape[4]))
    for l, h, kn, vn in new:
        kv_new[l, 0, h], kv_new[l, 1, h] = kn, vn
    return (x_L, kv_new) if z is None else (x_L, kv_new, z)


def attend(q, k, v, K_SH, V_SH, pos, rope, bf16, rows=None, owner=True):
    """One head's attention as the kernel computes it: q, k rotated (NeoX pairs) and
    rounded to bf16, scores of rows < pos and the new token, p = exp(s - m) in bf16, P V
    plus the new token's p v, over the sum. rows (r0, r1): a split's (`attention.split_tiles`),
    only rows r0 .. min(pos, r1) - 1, and the new token only if it owns it; the result is
    then (o, log2-sum-exp, k, v), an empty split's (0, -inf)."""
    half = len(q) // 2
    c, s = rope[:half], rope[half:]
    rot = lambda x: bf16(np.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s]))  # noqa: E731
    q, k, v = rot(q), rot(k), bf16(v)
    r0, r1 = (0, pos) if rows is None else (rows[0], min(pos, rows[1]))
    scores = np.concatenate([K_SH[r0:r1] @ q, [q @ k] if owner else []]) / np.sqrt(len(q))
    if scores.size == 0:
        return np.zeros_like(q), -np.inf, k, v
    e = np.exp(scores - scores.max())
    o = (bf16(e[:r1 - r0]) @ V_SH[r0:r1] + (e[-1] * v if owner else 0)) / e.sum()
    if rows is None:
        return o, k, v
    return o, (scores.max() + np.log(e.sum())) * np.log2(np.e), k, v


def gains(D, L):
    """The benchmark's RMSNorm gains (near 1), [L, D] each."""
    return experiment("bench_chain_mgpu").norm_gains(L, D)


def exact_chain(x0, wq, wo, wgu, wd, norms=None, eps=1e-5):
    """The chain without attention (`cx.reference`'s) in float64 throughout: no rounding."""
    wq, wo, wgu, wd = (np.asarray(w.astype(jnp.float32), np.float64) for w in (wq, wo, wgu, wd))
    D, F = wo.shape[1], wd.shape[2]

    def rms(v, g):
        return v if norms is None else v / np.sqrt(np.mean(v * v) + eps) * np.asarray(g, np.float64)

    x = np.asarray(x0, np.float64)
    for l in range(wq.shape[0]):
        h = x + wo[l] @ (wq[l] @ rms(x, None if norms is None else norms[0][l]))[:D]
        gu = wgu[l] @ rms(h, None if norms is None else norms[1][l])
        x = h + wd[l] @ (gu[:F] / (1 + np.exp(-gu[:F])) * gu[F:])
    return x


@pytest.mark.parametrize("blocks,norms,sums,packed", [
    (132, False, False, False), (5, False, False, False), (132, True, False, False), (5, True, False, False),
    (132, True, True, False), (5, True, True, False), (132, False, False, True), (5, True, True, True)])
def test_the_kernels_data_flow_computes_the_chain(blocks, norms, sums, packed):
    """The decomposition, word layout and input wiring the kernel uses, run in numpy, compute
    the chain as accurately as the XLA reference does, with and without RMSNorms (their gains
    folded into the weights as the kernel takes them; sums: their readers read square sums,
    not the vector; packed: pieces two values a word); on the GPU the kernel itself is
    checked against the reference.

    Both round each product's input to bf16, at different points (a packed piece is summed
    before its reader rounds), so each sits its own bf16 noise away from exact arithmetic:
    0.3% of |x_L| with the norms, 0.8-1.0% without (3 layers whose residual grows 30x), and
    the two apart by up to 1.4 times that. So the bound is on the distance to the float64
    chain, at most 1.5 times the reference's (0.83-1.23 times over seeds 0-3 and these
    cases); a piece lost, read twice or from the wrong layer moves x_L by 10% or more."""
    D, N1, F, L = 256, 768, 512, 3  # 3 layers: layer 2 reuses layer 0's region
    x0, wq, wo, wgu, wd = inputs(D, N1, F, L)
    g = gains(D, L) if norms else None
    if norms:
        wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
        got = emulate(x0, wq_f, wo, wgu_f, wd, blocks, norm_eps=1e-5, sums=sums, packed=packed)
        want = np.asarray(cx.reference(x0, wq, wo, wgu, wd, norms=g, eps=1e-5), np.float64)
    else:
        got = emulate(x0, wq, wo, wgu, wd, blocks, packed=packed)
        want = np.asarray(cx.reference(x0, wq, wo, wgu, wd), np.float64)
    exact = exact_chain(x0, wq, wo, wgu, wd, norms=g)
    assert np.linalg.norm(want - exact) <= 1.2e-2 * np.linalg.norm(exact)  # bf16's noise, not more
    assert np.linalg.norm(got - exact) <= 1.5 * np.linalg.norm(want - exact)


@pytest.mark.parametrize("blocks,vocab", [(132, 256), (5, 320), (7, 4096)])
def test_the_output_layers_data_flow_computes_the_logits(blocks, vocab):
    """w_head: the blocks' rectangles of the output layer cover every tile once from every
    chunk group, read x_L's chunks where the final chunks are read, and their pieces add up
    to the reference's table times bf16(x_L)."""
    D, N1, F, L = 256, 768, 512, 2
    x0, wq, wo, wgu, wd = inputs(D, N1, F, L)
    table = jax.random.normal(jax.random.key(5), (vocab, D), jnp.float32).astype(jnp.bfloat16)
    g = gains(D, L)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
    _, z = emulate(x0, wq_f, wo, wgu_f, wd, blocks, norm_eps=1e-5, sums=True, packed=True, w_head=table)
    want = np.asarray(cx.reference(x0, wq, wo, wgu, wd, norms=g, eps=1e-5, w_head=table)[1][0], np.float64)
    assert np.linalg.norm(z.sum(axis=0) - want) <= 1e-2 * np.linalg.norm(want)


@pytest.mark.parametrize("blocks,norms,pos,splits,spare,sums,packed", [
    (132, False, 70, (), True, False, False), (20, True, 0, (), True, False, False),
    (132, True, 129, (), False, False, False), (3, True, 129, (), True, False, False),
    (132, True, 70, (("gu", 2, 16), ("down", 8, 4)), True, False, False),  # an override: odd chunk counts
    (20, True, 0, (), True, True, False), (132, True, 129, (), False, True, False),
    (20, True, 0, (), True, True, True), (132, True, 70, (("gu", 2, 16), ("down", 8, 4)), True, False, True),
    (132, True, 70, (("gu", 3, 5), ("o", 1, 4)), False, True, True)])  # odd piece counts, packed
@pytest.mark.parametrize("att_splits", [1, 3])
def test_the_attention_data_flow_computes_the_chain(blocks, norms, pos, splits, spare, sums, packed, att_splits):
    """With attention: each head's block reads q, k, v through the kernel's wiring, its
    output words are what o reads, and x_L and the new k, v are the reference's (also with
    splits overridden, as `experiments/sweep_chain_splits.py` runs them, and with o split
    over all blocks, spare=False, or over those that do not attend, the default; and with
    each head's positions split over 3 blocks, some of them empty at pos 0 and 70)."""
    D, N1, F, L, H = 256, 768, 512, 3, 2
    if blocks < H * att_splits:
        pytest.skip("fewer blocks than attention blocks")
    x0, wq, wo, wgu, wd = inputs(D, N1, F, L)
    att = attention_inputs(L, D, 192, pos, heads=H)
    g = gains(D, L) if norms else None
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g) if norms else (wq, wgu)
    got, got_kv = emulate(x0, wq_f, wo, wgu_f, wd, blocks, norm_eps=1e-5 if norms else None, att=att,
                          splits=splits, att_blocks=H * att_splits if spare else 0, sums=sums, packed=packed,
                          att_splits=att_splits)
    want, want_kv = cx.reference(x0, wq, wo, wgu, wd, *att, norms=g, eps=1e-5)
    want, want_kv = np.asarray(want, np.float64), np.asarray(want_kv.astype(jnp.float32), np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    assert np.linalg.norm(got_kv - want_kv) <= 1e-2 * np.linalg.norm(want_kv)


@pytest.mark.parametrize("L,blocks,packed,first_epoch,embed,att_splits", [
    (3, 20, True, 0, False, 1), (2, 132, False, 254, False, 1), (3, 20, True, 0, True, 1), (2, 132, True, 254, True, 1),
    (3, 20, True, 255, True, 3)])
def test_a_kept_state_serves_call_after_call(L, blocks, packed, first_epoch, embed, att_splits):
    """chain_mgpu(state=...)'s words outlive the call: through the kernel's wiring, calls one
    after another on one state (positions 70, 71, then 70 again: a rollback; the epoch
    wrapping round) each read only words of their own epoch, overwrite only the call
    before's (or their own from two layers back) and give the reference's x_L and new k, v;
    also with x_0's words written into the state by the kernel (embed), and with each head's
    positions split over 3 blocks (their outputs' and log2-sum-exps' words kept too)."""
    D, N1, F = 256, 768, 512
    state = dict(epoch=first_epoch)
    for i, pos in enumerate((70, 71, 70)):
        x0, wq, wo, wgu, wd = inputs(D, N1, F, L, seed=i)
        att = attention_inputs(L, D, 128, pos, heads=2)
        g = gains(D, L)
        wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
        got, got_kv = emulate(x0, wq_f, wo, wgu_f, wd, blocks, norm_eps=1e-5, att=att, att_blocks=2 * att_splits,
                              sums=True, packed=packed, state=state, embed=embed, att_splits=att_splits)
        want, want_kv = cx.reference(x0, wq, wo, wgu, wd, *att, norms=g, eps=1e-5)
        want, want_kv = np.asarray(want, np.float64), np.asarray(want_kv.astype(jnp.float32), np.float64)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
        assert np.linalg.norm(got_kv - want_kv) <= 1e-2 * np.linalg.norm(want_kv)
        assert state["epoch"] == (first_epoch + i + 1) % plan.EPOCHS
    assert ((state["tags"] - 2) // 256 == (first_epoch + 2) % plan.EPOCHS).sum() > 0


@pytest.mark.parametrize("D,hd,kv_heads,blocks,group,options", [
    (512, 64, 2, 132, None, {}), (512, 64, 8, 132, None, {}), (512, 128, 1, 9, None, {}),
    (768, 64, 4, 20, None, {}), (512, 64, 2, 132, 1, {}), (512, 64, 2, 20, 2, {}),
    (512, 64, 2, 132, 1, dict(sums=True, packed=True)), (512, 128, 1, 9, None, dict(sums=True, packed=True)),
    (512, 64, 2, 132, 1, dict(sums=True, packed=True, att_splits=2)), (512, 128, 1, 9, None, dict(att_splits=4))])
def test_the_grouped_query_data_flow_computes_the_chain(D, hd, kv_heads, blocks, group, options):
    """Grouped-query attention (D / hd query heads over kv_heads: groups of 4, 1 (multi-head),
    4 at head_dim 128, 3): each attention block reads its query heads' q and their kv head's
    k and v through the kernel's wiring and x_L and the new k, v are the reference's (also
    with the norms' square sums and packed pieces)."""
    F, L, pos = 256, 3, 70
    x0, wq, wo, wgu, wd = gqa_inputs(D, hd, kv_heads, F, L)
    att = attention_inputs(L, D, 128, pos, heads=D // hd, kv_heads=kv_heads)
    g = gains(D, L)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
    spare = D // hd // (group or ca.group_of(D // hd, kv_heads)) * options.get("att_splits", 1)  # o elsewhere
    got, got_kv = emulate(x0, wq_f, wo, wgu_f, wd, blocks, norm_eps=1e-5, att=att, att_blocks=spare,
                          group=group, **options)
    want, want_kv = cx.reference(x0, wq, wo, wgu, wd, *att, norms=g, eps=1e-5)
    want, want_kv = np.asarray(want, np.float64), np.asarray(want_kv.astype(jnp.float32), np.float64)
    assert got_kv.shape == (L, 2, kv_heads, hd)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    assert np.linalg.norm(got_kv - want_kv) <= 1e-2 * np.linalg.norm(want_kv)


def test_groups_fit_the_accumulator_columns():
    """A block attends with the largest divisor of the group size that fits B's 8 rows."""
    assert [ca.group_of(n, k) for n, k in ((32, 8), (32, 4), (15, 5), (32, 32), (32, 2), (24, 2), (22, 2))] == \
        [4, 8, 3, 1, 8, 6, 1]


def test_the_default_group_spreads_the_heads_while_the_blocks_suffice():
    """Without a measured choice a block takes one query head, unless the query heads
    outnumber the blocks: then the fewest that leave a block free (the widest if none does),
    and the kernel takes it."""
    assert [ca.default_group(n, k, 132) for n, k in ((32, 8), (32, 4), (15, 5), (32, 32))] == [1, 1, 1, 1]
    assert ca.default_group(32, 4, 20) == 2 and ca.default_group(32, 4, 16) == 4
    assert ca.default_group(64, 8, 8) == 8 and ca.default_group(24, 2, 3) == 6
    S = jax.ShapeDtypeStruct
    D, K, hd = 2048, 4, 64  # TinyLlama's attention: 32 query heads over 4 kv heads
    N1, F = D + 2 * K * hd, 256
    args = (S((D,), jnp.float32), S((2, N1, D), jnp.bfloat16), S((2, D, D), jnp.bfloat16),
            S((2, 2 * F, D), jnp.bfloat16), S((2, D, F), jnp.bfloat16),
            S((2, 2, K, 128, hd), jnp.bfloat16), S((1,), jnp.int32), S((hd,), jnp.float32))
    text = lowered_for_sm90(lambda *a: cc.chain_mgpu(*a, blocks=132, norm_eps=1e-5), *args)
    assert "ROPE_Q0" in text and "ROPE_Q1:" not in text  # one query head a block


@pytest.mark.skipif(ON_SM90, reason="the benchmark's CPU path (a GPU runs the benchmark itself)")
def test_benchmark_dry_run_on_the_cpu(tmp_path):
    """experiments/bench_chain_mgpu.py --dry: the splits and XLA's chain, timed, to JSON."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + sys.path)}
    subprocess.run([sys.executable, str(root / "experiments" / "bench_chain_mgpu.py"), "--dry",
                    "--presets", "350m", "--out", str(tmp_path)], check=True, env=env, cwd=root,
                   capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "bench_chain_mgpu.json").read_text())["rows"]
    assert rows[0]["preset"] == "350m" and rows[0]["xla"]["us"] > 0
    assert set(rows[0]["splits"]) == {"qkv", "o", "gu", "down"}


def test_trace_analysis_recovers_a_known_schedule():
    """experiments/trace_chain.py's critical path from synthetic stamps (a 10 us layer with
    known handovers and work, the 32-bit timer wrapping mid-kernel, then the output layer in
    the last layer's points): every segment back."""
    tc = experiment("trace_chain")
    NB, L, P = 24, 4, len(cm.TRACE_POINTS)
    sched = dict(qkv=(0, 1, 2), att=(2, 2.5, 4.5), o=(4.6, 5.2, 6), gu=(6, 6.5, 8), down=(8, 8.4, 9.5))
    raw = np.zeros((NB, L, P, 2), np.int64)
    t0 = 2**32 - 15000  # wraps in layer 1
    for b in range(NB):
        for l in range(L):
            for p, (start, inp, done) in sched.items():
                if p == "att" and b < NB - 4:
                    continue
                names = (p, p + "_in", p + "_out")
                for k, v in zip(names, (start, inp, done), strict=True):
                    us = l * 10 + v
                    raw[b, l, cm.TRACE_POINTS.index(k)] = [(t0 + int(us * 1000)) % 2**32, int(us * 1800) + 7]
    for b in range(NB - 6):  # the output layer's blocks, after the last layer's down
        for k, us in zip(("head", "head_in", "head_out"), (40.2, 41.0, 47.5 + 0.1 * b), strict=True):
            raw[b, L - 1, cm.TRACE_POINTS.index(k)] = [(t0 + int(us * 1000)) % 2**32, int(us * 1800) + 7]
    got = tc.analyse(raw.astype(np.uint32).view(np.int32), L)
    assert got["head_us"]["handover"] == pytest.approx(41.0 - 39.5, abs=2e-3)
    assert got["head_us"]["work"] == pytest.approx(47.5 + 0.1 * (NB - 7) - 41.0, abs=2e-3)
    med = got["us_per_layer_median"]
    want = dict(qkv_handover=1.5, qkv_work=1.0, att_handover=0.5, att_work=2.0, o_handover=0.7,
                o_work=0.8, gu_handover=0.5, gu_work=1.5, down_handover=0.4, down_work=1.1, period=10.0)
    for k, v in want.items():
        assert med[k] == pytest.approx(v, abs=2e-3), k
    assert got["sm_ghz"] == pytest.approx(1.8, rel=1e-3)


def test_trace_analysis_measures_the_seams_between_greedy_steps():
    """trace_chain.analyse(steps=2): step t's layer l at t L + l; the layers' medians over
    both steps' layers 1 .. L-1, and the seam: the output layer's handover and work, the
    choice's handover and work, layer 0's q|k|v handover after x_0's words, the seam's period."""
    tc = experiment("trace_chain")
    NB, L, steps, P = 24, 3, 2, len(cm.TRACE_POINTS)
    sched = dict(qkv=(0, 1, 2), o=(2, 2.7, 3.5), gu=(3.5, 4, 6), down=(6, 6.5, 9.5))
    raw = np.zeros((NB, steps * L, P, 2), np.int64)
    at = lambda lt, us: [(1000 + int(((lt * 10) + (2.2 if lt >= L else 0) + us) * 1000)), 7]  # noqa: E731
    for b in range(NB):
        for lt in range(steps * L):
            for p, times in sched.items():
                for k, v in zip((p, p + "_in", p + "_out"), times, strict=True):
                    raw[b, lt, cm.TRACE_POINTS.index(k)] = at(lt, v)
        for t in range(steps):  # the head's four blocks, then x_0's writers' choice, in layer L - 1
            lt = t * L + L - 1
            if b < 4:
                for k, v in (("head", 9.6), ("head_in", 10.1), ("head_out", 11.1)):
                    raw[b, lt, cm.TRACE_POINTS.index(k)] = at(lt, v)
            if b < 16:
                for k, v in (("choose", 9.7), ("choose_in", 11.9), ("choose_out", 12.3)):
                    raw[b, lt, cm.TRACE_POINTS.index(k)] = at(lt, v)
    got = tc.analyse(raw.astype(np.uint32).view(np.int32), L, steps)
    want = dict(head_handover=0.6, head_work=1.0, choose_handover=0.8, choose_work=0.4, qkv_handover=0.9,
                period=12.2)
    for k, v in want.items():
        assert got["seam_us"][k] == pytest.approx(v, abs=2e-3), k
    med = got["us_per_layer_median"]
    assert med["period"] == pytest.approx(10.0, abs=2e-3) and med["qkv_handover"] == pytest.approx(1.5, abs=2e-3)
    assert tc.analyse(raw[:, :L].astype(np.uint32).view(np.int32), L)["seam_us"] == {}


def test_trace_finds_each_readers_own_sources():
    """trace_chain.after_sources: a reader's input stamp against the last finish among the
    blocks that write the pieces it reads (the previous layer's down for q|k|v, o for
    gate|up, gate's and up's tiles for down), not against the product's last writer. Synthetic
    stamps: writers finish at staggered times, each reader's input a known delay after its
    own sources (q|k|v 0.3 µs, gate|up 0.5, down 0.9); half the down readers begin to poll
    after their sources."""
    tc = experiment("trace_chain")
    NB, L, P = 16, 4, len(cm.TRACE_POINTS)
    prods = plan.products(256, 768, 512, NB)
    delay = dict(qkv=0.3, gu=0.5, down=0.9)
    ns = np.zeros((NB, L, P))
    at = lambda name: cm.TRACE_POINTS.index(name)  # noqa: E731
    rng = np.random.default_rng(0)
    for l in range(L):
        for p in prods:
            ns[:, l, at(p.name + "_out")] = l * 100 + 10 * prods.index(p) + rng.uniform(0, 5, NB)
    for l in range(1, L - 1):
        for name, src, dl, offs in (("qkv", prods[3], -1, (0,)), ("gu", prods[1], 0, (0,)),
                                    ("down", prods[2], 0, (0, prods[2].N // 2 // 64))):
            p = prods[("qkv", "o", "gu", "down").index(name)]
            for b in range(p.split.sk * p.split.st):
                k0, k1 = plan.rect(p, b)[3:]
                tiles = {c + o for c in range(k0, k1) for o in offs}  # the tiles b reads, their writers:
                ready = max(ns[s, l + dl, at(src.name + "_out")] for s in range(NB)
                            if plan.rect(src, s)[0] and any(plan.rect(src, s)[1] <= t < plan.rect(src, s)[2]
                                                            for t in tiles))
                ns[b, l, at(name + "_in")] = ready + delay[name]
                ns[b, l, at(name)] = ready + (0.1 if name == "down" and b % 2 else -1.0)
    raw = np.zeros((NB, L, P, 2), np.int64)
    raw[..., 0] = (ns * 1000).astype(np.int64) + 1000
    raw[..., 1] = raw[..., 0]
    got = tc.after_sources(raw.astype(np.int32), L, prods)
    for name, d in delay.items():
        assert got[name]["input_after_sources_us"] == pytest.approx(d, abs=2e-3), name
    assert got["qkv"]["polled_after_sources"] == 0.0 and got["down"]["polled_after_sources"] == 0.5
    assert got["down"]["gather_alone_us"] == pytest.approx(0.8, abs=2e-3)  # began 0.1 after its sources


def test_step_variants_name_their_kernel_options(monkeypatch):
    """decode_floor's `chain@OPTS`: ring slots, spare, splits, group, prefetch, tiles, inflight,
    loads, sums and packed reach the kernel; none given
    leaves the kernel its measured choice; a bad option names the ones there are; the
    suffixes reach the plan (`+fused+state`: the output layer inside, the words kept; `+steps8`:
    eight greedy steps a kernel call)."""
    df = experiment("decode_floor")
    stages, kernel = df.chain_options("12,spare=0,qkv=16x8,o=8x14")
    assert stages == 12 and kernel.func is cc.chain_mgpu
    assert kernel.keywords == dict(spare=False, splits=(("qkv", 16, 8), ("o", 8, 14)))
    assert df.chain_options("")[1].keywords == {} and df.chain_options("20")[1].keywords == {}
    assert df.chain_options("spare=1")[1].keywords == dict(spare=True, splits=())  # over the cost model
    assert df.chain_options("group=1")[1].keywords == dict(group=1)  # the measured splits stay
    assert df.chain_options("16,prefetch=8")[1].keywords == dict(prefetch=8)
    assert df.chain_options("tiles=4")[1].keywords == dict(tiles=4)
    assert df.chain_options("tiles=4,sums=1,packed=1")[1].keywords == dict(tiles=4, norm_sums=True, packed=True)
    assert df.chain_options("sums=0,packed=0")[1].keywords == dict(norm_sums=False, packed=False)
    assert df.chain_options("inflight=2")[1].keywords == dict(inflight=2)
    assert df.chain_options("loads=4")[1].keywords == dict(loads=4)
    assert df.chain_options("att_splits=4")[1].keywords == dict(att_splits=4)
    assert df.chain_options("blocks=66")[1].keywords == dict(blocks=66)
    with pytest.raises(ValueError, match=re.escape("att_splits=N, blocks=N, sums=0|1, packed=0|1 or NAME=SKxST")):
        df.chain_options("16,mlp=2x4")
    asked = []  # what a variant asks the front door for
    monkeypatch.setattr(df.decoder, "plan", lambda *a, **kw: asked.append(kw))
    df.case_plan(None, None, 1, "chain@20+fused+state", 64)
    df.case_plan(None, None, 1, "chain", 64)
    assert asked[0]["stages"] == 20 and asked[0]["head"] == "fused" and asked[0]["kernel_state"] is True
    assert "head" not in asked[1] and asked[1]["kernel_state"] is None  # the plan's default
    df.case_plan(None, None, 1, "chain+fresh", 64)
    assert asked[2]["kernel_state"] is False
    df.case_plan(None, None, 1, "chain+fused+state+steps8", 64)
    assert asked[3]["greedy_steps"] == 8 and asked[3]["kernel_state"] is True and asked[1]["greedy_steps"] is None


def test_the_tuner_finds_an_interaction_and_proposes_splits_that_fit():
    """tune_chain_splits: each alternative is a split the kernel takes (o's within the blocks
    it may use), a candidate's variant reaches the kernel as itself, and the descent finds a
    change that pays only together with spare (as q|k|v 16x8 did at 1b) and a narrower
    attention group, keeping no change below its gain."""
    tc = experiment("tune_chain_splits")
    D, N1, F = SHAPES["1b"]
    for spare in (False, True):
        alts = tc.alternatives(D, N1, F, 132, 16, spare)
        for name, splits in alts.items():
            assert splits and len({sk for sk, _ in splits}) == len(splits)
            for sk, st in splits:
                plan.products(D, N1, F, 132, True, ((name, sk, st),), att_blocks=16 if spare else 0)
    c = tc.Candidate(spare=True, group=2).split("qkv", (16, 8)).split("gu", (3, 44))
    kw = experiment("decode_floor").chain_options(c.variant().partition("@")[2])[1].keywords
    assert kw == dict(spare=True, group=2, splits=(("gu", 3, 44), ("qkv", 16, 8)))

    def time_ms(c):  # 10 ms; qkv 16x8 -9% with spare only; spare alone +2%; group 2 -1%
        ms = 10.0 * (1.02 if c.spare else 1.0)
        if dict(c.splits).get("qkv") == (16, 8) and c.spare:
            ms *= 0.91 / 1.02
        return ms * (0.99 if c.group == 2 else 1.0) * (0.999 if dict(c.splits).get("gu") == (3, 44) else 1.0)

    alts = lambda spare, group: tc.alternatives(D, N1, F, 132, 16, spare)  # noqa: E731
    best, ms, seen = tc.descend(time_ms, alts, groups=(None, 1, 2))
    assert best == tc.Candidate(splits=(("qkv", (16, 8)),), spare=True, group=2)
    assert abs(ms - 10.0 * 0.91 * 0.99) < 1e-9
    assert tc.Candidate().variant() in seen and best.split("gu", (3, 44)).variant() in seen
    best, ms, _ = tc.descend(lambda c: 10.0, alts, groups=(None, 1))
    assert (best, ms) == (tc.Candidate(), 10.0)  # nothing pays: the cost model's stay
    best, ms, seen = tc.descend(lambda c: 10.0 * (0.95 if c.tiles == 4 else 1.0), alts, tiles=(1, 2, 4))
    assert best == tc.Candidate(tiles=4) and abs(ms - 9.5) < 1e-9  # a tile count tried and kept
    assert best.variant() == "chain@16,spare=0,tiles=4" and tc.Candidate(tiles=2).variant() in seen
    _, _, seen = tc.descend(lambda c: 10.0, alts, options="sums=1,packed=1")  # every candidate takes them
    assert all(v.endswith(",sums=1,packed=1") or ",sums=1,packed=1," in v for v in seen), seen
    kw = experiment("decode_floor").chain_options(max(seen).partition("@")[2])[1].keywords
    assert kw["norm_sums"] and kw["packed"] and kw["splits"]


def test_ptxas_report_reads_registers_spills_and_serialisation():
    """`experiments/chain_spills.py` reads ptxas's verbose report: the kernel's registers and
    spills, whether its wgmma are serialised (C7520) and how many arrives ptxas added."""
    report = experiment("chain_spills").report
    text = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 12 by compiler to allow use of "
            "registers in GMMA in function 'decode_chain_mosaic_gpu_kernel'\n"
            "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'\n"
            "    32 bytes stack frame, 28 bytes spill stores, 44 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 16 barriers, 32 bytes cumulative stack size\n")
    got = report(text)
    assert (got["registers"], got["spill_store_bytes"], got["spill_load_bytes"]) == (255, 28, 44)
    assert got["wgmma_serialised"] and got["injected_arrives"] == 1 and got["warnings"][0].startswith("C7520")
    clean = report("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 186 registers\n")
    assert not clean["wgmma_serialised"] and clean["registers"] == 186 and clean["warnings"] == []
