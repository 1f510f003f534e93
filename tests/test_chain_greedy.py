"""Greedy steps inside the decode megakernel (`chain_mgpu(steps=N)`): lowering and the
option's checks on the CPU; on an sm90 GPU, N steps in one call give the tokens, cache and
x_L of N one-step calls whose argmax XLA takes."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lowered_for_sm90
from test_chain_mgpu import (
    ATTENTION,
    ON_SM90,
    assert_polls_are_the_warps,
    attention_inputs,
    attention_specs,
    gains,
    gqa_inputs,
    rope_table_around,
)

from pallas_kernels.chain import call as cc
from pallas_kernels.chain import kernel as cm
from pallas_kernels.chain import plan
from pallas_kernels.chain import xla as cx
from pallas_kernels.chain.resolve import MAX_STEPS


def greedy_specs(shape: str, vocab: int):
    """(table, token), the layers' weights, kv, pos, angles and w_head as shapes, and the
    state's size for them."""
    args = attention_specs(shape)
    D = args[2].shape[1]
    S = jax.ShapeDtypeStruct
    lead = (S((vocab, D), jnp.bfloat16), S((1,), jnp.int32))
    w_head = S((vocab, D), jnp.bfloat16)
    n = cc.state_size(None, *args[1:], blocks=132, norm_eps=1e-5, embed=lead, w_head=w_head)
    return lead, args[1:], w_head, n


def test_the_head_splits_by_whole_rows_for_the_choice():
    """Greedy steps read the head one piece a tile (each block's sums are logits), over
    min(tiles, blocks) blocks; a state with the head and the token's row holds two words of
    each such block, whatever the call's steps."""
    assert plan.head_product(256, 1024, 132, whole_rows=True).split == plan.Split(1, 4)
    assert plan.head_product(128256, 2048, 132, whole_rows=True).split == plan.Split(1, 132)
    assert plan.head_product(256, 1024, 132).split.sk > 1  # the cost model's: pieces over more blocks
    lead, args, w_head, n = greedy_specs("350m", 256)
    without = cc.state_size(None, *args, blocks=132, norm_eps=1e-5, embed=lead)
    assert n == without + 4 * 4


@pytest.mark.parametrize("shape,vocab", [("350m", 256), ("llama3.2-1b", 128256)])
def test_greedy_steps_lower_with_their_choice(shape, vocab):
    """steps=4: the result is (y, kv, tokens [4], state, pos), kv, state and pos written in
    place; the head blocks keep each column's best (a predicated compare, no branch) and
    publish two words; the token's readers poll them as warps; the new k and v are fenced
    for the next step's TMA reads; the last block out advances the epoch and pos by 4."""
    lead, args, w_head, n = greedy_specs(shape, vocab)

    def f(table, token, *a):
        return cc.chain_mgpu(None, *a[:-2], blocks=132, norm_eps=1e-5, state=a[-1], embed=(table, token),
                             advance=True, w_head=a[-2], steps=4)

    st = jax.ShapeDtypeStruct((n,), jnp.int32)
    out = jax.eval_shape(f, *lead, *args, w_head, st)
    assert [o.shape for o in out] == [(args[1].shape[1],), args[4].shape, (4,), (n,), (1,)]
    text = lowered_for_sm90(f, *lead, *args, w_head, st)
    assert "setp.gt.or.f32 f, v, b, f" in text  # track
    assert "vote.sync.any.pred r, r, -1; @r bra.uni GRP" in text  # choose's warp poll
    assert "fence.proxy.async.global;" in text and "fence.acq_rel.gpu" not in text  # the new k and v, for TMA
    assert "@q add.u32 e, e, 4" in text  # epoch and pos
    assert_polls_are_the_warps(text)
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d+)", text)
    assert sorted(int(i) for _, i in aliases) == [5, 6, 10]  # kv, pos, the state


def test_greedy_steps_trace_every_step():
    """trace=True with steps=4 lowers, its stamps an output of 4 L layers (step t's layer l
    at t L + l). (That the choice's points are written is the GPU's to show: the seams
    `trace_chain.py --steps` measures from them.)"""
    lead, args, w_head, n = greedy_specs("350m", 256)
    L = args[0].shape[0]

    def f(table, token, *a):
        return cc.chain_mgpu(None, *a[:-2], blocks=132, norm_eps=1e-5, state=a[-1], embed=(table, token),
                             advance=True, w_head=a[-2], steps=4, trace=True)

    st = jax.ShapeDtypeStruct((n,), jnp.int32)
    out = jax.eval_shape(f, *lead, *args, w_head, st)
    assert out[3].shape == (132, 4 * L, len(cm.TRACE_POINTS), 2)
    text = lowered_for_sm90(f, *lead, *args, w_head, st)
    assert "%globaltimer" in text and "ZW_L" in text


def test_bad_steps_are_refused():
    lead, args, w_head, n = greedy_specs("350m", 256)
    state = jax.ShapeDtypeStruct((n,), jnp.int32)

    def call(**kw):
        kw = {**dict(blocks=132, norm_eps=1e-5, state=state, embed=lead, advance=True, w_head=w_head, steps=4),
              **kw}
        return jax.eval_shape(lambda: cc.chain_mgpu(None, *args, **kw))

    call()
    for bad in (dict(steps=0), dict(steps=MAX_STEPS + 1), dict(w_head=None), dict(norm_eps=None),
                dict(att_splits=2)):
        with pytest.raises(ValueError, match="steps="):
            call(**bad)
    with pytest.raises(ValueError, match="pass advance=True"):
        call(advance=False)


@pytest.mark.skipif(not ON_SM90, reason="the LL words move by inline PTX: an sm90 GPU only")
@pytest.mark.parametrize("preset,vocab,pos,steps", [("350m", 256, 126, 4), ("llama3.2-1b", 4096, 60, 4),
                                                   ("draft-1024", 256, 125, 3)])
def test_greedy_steps_match_one_step_calls_on_the_gpu(preset, vocab, pos, steps):
    """Two calls of `steps` greedy steps from pos (crossing a 64-position tile; each step reads
    the rows the steps before it wrote, which its producer loads only after they are written:
    two layers of few items a block let it run a step ahead) give the tokens of 2 `steps`
    one-step calls that take the argmax of their logits' pieces in XLA, the same cache (bit
    for bit), the last x_L and the position moved on by 2 `steps`. (draft-1024: the shape of
    speculative decoding's draft, whose calls take γ - 1 steps.)"""
    D, F, NQ, K, hd = ATTENTION[preset]
    _, wq, wo, wgu, wd = gqa_inputs(D, hd, K, F, 2)
    g = gains(D, 2)
    wq_f, wgu_f = cx.fold_norms(wq, wgu, *g)
    kv, _, rope = attention_inputs(2, D, 320, pos, heads=NQ, kv_heads=K)
    angles = rope_table_around(rope, pos, 320)
    emb = jax.random.normal(jax.random.key(9), (vocab, D), jnp.float32).astype(jnp.bfloat16)
    w_head = cx.fold_head(jax.random.normal(jax.random.key(7), (vocab, D)).astype(jnp.bfloat16), g[0][0])
    opts = dict(norm_eps=1e-5, w_head=w_head, advance=True)

    def call(token, kv, p, state, steps):
        return cc.chain_mgpu(None, wq_f, wo, wgu_f, wd, kv, p, angles, state=state, embed=(emb, token),
                             steps=steps, **opts)
    one = jax.jit(lambda token, kv, p, state: call(token, kv, p, state, 1))
    many = jax.jit(lambda token, kv, p, state: call(token, kv, p, state, steps))
    p0 = jnp.array([pos], jnp.int32)
    n = cc.state_size(None, wq_f, wo, wgu_f, wd, kv, p0, angles, embed=(emb, p0), **opts)
    token, kv1, p1, st1 = jnp.array([7], jnp.int32), kv, p0, jnp.zeros((n,), jnp.int32)
    want = []
    for _ in range(2 * steps):
        y1, kv1, z, st1, p1 = one(token, kv1, p1, st1)
        token = jnp.argmax(z.sum(axis=0))[None].astype(jnp.int32)
        want.append(int(token[0]))
    token, kv2, p2, st2 = jnp.array([7], jnp.int32), kv, p0, jnp.zeros((n,), jnp.int32)
    got = []
    for _ in range(2):
        y2, kv2, toks, st2, p2 = many(token, kv2, p2, st2)
        got += [int(t) for t in toks]
        token = toks[-1:]
    assert got == want
    assert int(p2[0]) == pos + 2 * steps and int(st2[-2]) == 2 * steps and int(st2[-1]) == 0
    np.testing.assert_array_equal(np.asarray(kv2, np.float32), np.asarray(kv1, np.float32))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y1))
