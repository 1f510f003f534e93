"""A batch-1 decode step's layers, every layer, as ONE persistent Mosaic GPU kernel whose
phases hand activations over as low-latency words: the decode megakernel (Hopper, sm90;
on the decode path through `gendist.inference.megakernel`).

Per layer l, from the residual stream x_l [D] (fp32):
    a   = Wqkv_l n_l(x_l)                 [N1]
    h_l = x_l + Wo_l att(a)                (with kv: multi-head or grouped-query attention of
                                            the new token, `attention`; without: a[:D] goes
                                            straight on)
    g   = Wgu_l m_l(h_l)                   [2F]
    x_{l+1} = h_l + Wd_l (silu(g[:F]) * g[F:])
with every product's input rounded to bf16 (as the decode path's products read it) and fp32
sums; n_l, m_l are RMSNorms (`norm_eps`; their gains folded into Wqkv's and Wgu's columns,
`xla.fold_norms`, and the factor rsqrt(mean(v^2) + eps) applied by the readers of the product's
output, each block summing the squares of the dense residual itself) or the identity.
Without kv the kernel is the weight chain alone: what the weight stream and the phase
boundaries cost.

Why (benchmarks/decode.md): a decode step at batch 1 is ~230 kernels that each pay
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
weights run ahead across phases and layers. The LL words live in a global semaphore array
(zeroed before the kernel) of two layers' regions: layer l's words carry tag l + 2 and go
to region l % 2, overwritten two layers later (`plan.tag`: why that is safe).
Every poll traps after `_mgpu.SPIN_LIMIT` tries: a word never written is a CUDA error, not
a hung GPU. (The zeroing is a memset of the array each call: ~4 MB at 1b; a region a layer
would be 44 MB, written again by the words themselves: ~4% of a step's bytes.) A decode loop
can keep the words instead (`state`): each call's tags carry its epoch, which the last block
out advances, so nothing zeroes them; the kernel then writes the new k and v into the cache
itself, (`embed`) reads the token's embedding row and (`advance`) moves the cache's length on:
a step is four XLA kernels shorter.

GPU only (the words are moved by inline PTX, which Mosaic GPU's interpreter does not run);
`xla.reference` is the same math in XLA; `plan` holds the decomposition, the word layout
and the input wiring (CPU-testable), `words` the inline-PTX word movers, `ring` the
producer's waits on its weight ring, `scratch` its shared memory.
"""
from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import WGMMA, launch, prefetch_rows_l2, stamp, zero_words
from pallas_kernels.chain import attention as ca
from pallas_kernels.chain import greedy as gr
from pallas_kernels.chain import ring as rw
from pallas_kernels.chain import words as cw
from pallas_kernels.chain.plan import (
    EPOCHS,
    KC,
    REGIONS,
    Reads,
    T,
    greedy_word,
    head_reads,
    init_words,
    input_spec,
    kept_layout,
    layout,
    piece_word,
    product_reads,
    rect,
    region,
    tag,
)
from pallas_kernels.chain.resolve import Call
from pallas_kernels.chain.scratch import shared_memory

SCORE_GROUP = 4  # K tiles whose score products are in flight at once
# Trace points a layer (`chain_mgpu(trace=True)`): product i's start, input gathered and
# pieces written at 3 i .. 3 i + 2 (qkv, o, gu, down), then the attention head's start,
# q|k|v gathered, rotated, scores, softmax, output written; then, in the last layer's only,
# the output layer's (`w_head`) start, input gathered and last tile stored, and a greedy
# call's choice (`greedy.choose`) of the next token: started, token known, x_0's words written.
# A call of N steps stamps N L layers: step t's layer l at t L + l.
TRACE_POINTS = ("qkv", "qkv_in", "qkv_out", "o", "o_in", "o_out", "gu", "gu_in", "gu_out",
                "down", "down_in", "down_out", "att", "att_in", "att_rope", "att_scores",
                "att_softmax", "att_out", "head", "head_in", "head_out", "choose", "choose_in",
                "choose_out")


def column(acc_T8, g: int = 0):
    """Column g of a [64, 8] wgmma accumulator (B's row g: a product's input is row 0, a
    query head's q or p row g of its group): [64]."""
    col = plgpu.broadcasted_iota(jnp.int32, (T, 8), 1, layout=WGMMA) == g
    return jnp.where(col, acc_T8, 0.0).sum(axis=1)


def words(groups) -> int:
    """LL words a lane polls a pass for an input read from `groups` (`input_spec`'s): a
    packed group's half (a lane pair shares its words, `words.gather`)."""
    return sum(-(-g.count // 2) if g.packed else g.count for g in groups)


def kernel_call(x0_D, w_qkv, w_o, w_gu, w_down, call: Call, norm_eps: float | None,
                state=None, advance: bool = False):  # noqa: C901  (one kernel's phases share its closures)
    """The kernel of one `chain_mgpu` call, built and launched: what it runs and how, `call`
    (`resolve.Call`, its schedule `call.sched`, `resolve.Schedule`, resolved). Of the call:
    attn: None (o reads q|k|v's q part) or (kv [L, 2, H, S, hd] bf16, pos [1] int32,
    rope [hd] fp32 (cos | sin of pos's angles) or [R >= S, hd] (row p: position p's)): the
    attention phase (`attention`) of D / hd query heads over H kv heads, `group` query heads
    (of one kv head) a block. head: None or (w_head [V, D] bf16, its `plan.head_product`):
    the output layer after the last layer, its pieces [sk V] fp32 an output. state: None
    (the LL words zeroed each call, the new k and v an output) or the words kept between
    calls (int32 [`state_size`]): the kernel reads and writes them and writes the new k and v
    into kv in place, and the result ends in (kv, state) after the call. embed: None (x_0 is
    x0_D) or, with a state, (table [V, D] bf16, token [1] int32): x_0 is the token's row,
    which the kernel reads and writes as the host's words itself (`kept_layout`). advance:
    with a state, the last block out also adds one to pos (in place), which then follows
    (kv, state) in the result. call.steps N > 1 (with state, embed, head and advance): N
    greedy steps, each step's token the argmax of its logits (`greedy`), chosen by the blocks
    that write x_0's chunks, which then write the next step's x_0 from its row: the result
    (y, tokens [N] int32, [trace], kv, state, pos + N), y the last step's x_L, no z. The
    schedule's options are `chain_mgpu`'s of the same names."""
    prods, blocks, attn, group, head, embed = call.prods, call.blocks, call.attn, call.group, call.head, call.embed
    stages, tiles, inflight, loads, prefetch, norm_sums, packed, trace, att_loads, R = call.sched
    uneven = attn is not None and att_loads is not None and att_loads != loads  # the attention blocks' own cap
    L, D = w_o.shape[0], w_o.shape[1]
    F = w_down.shape[2]
    kept = state is not None
    lay = layout(prods, D, attn is not None, packed, R)
    if embed is not None:  # the host's words in the state, after the LL words
        lay = kept_layout(lay)
    epoch_at = call.state_words - 2  # the kept state's epoch (int32; its count the next)
    steps = call.steps
    greedy = steps > 1  # the kernel chooses each step's token and reads its row
    n_ll = 2 * REGIONS * lay.layer_words  # the LL words' int32s
    if embed is None:
        first_in = init_words(x0_D, prods, lay, state[epoch_at] if kept else 0)
    else:
        first_in = embed[0]
    NB, st, TG = blocks, stages, tiles
    w_head, hp = head if head is not None else (None, None)
    kmax = max(p.kmax() for p in prods + ((hp,) if hp is not None else ()))
    qkv, o, gu, down = prods
    if attn is not None:
        kv = attn[0]
        H, S, hd = kv.shape[2], kv.shape[3], kv.shape[4]
        nc = hd // T  # 64-wide chunks of a head
        scale_log2 = ca.LOG2E / math.sqrt(hd)
        NQ = D // hd  # query heads
        GB = group  # query heads a block attends with (one kv head's)
        A = NQ // GB  # query groups, each attended by R blocks (one a split of its positions)
        per_kv = (NQ // H) // GB  # query groups a kv head

    def counts(b, pos=None):  # items a layer, and where each phase starts, for block b (traced)
        n, before = 0, {}
        for p in prods:
            active, t0, t1, k0, k1 = rect(p, b)
            before[p.name] = n
            n = n + jnp.where(active, (t1 - t0) * (k1 - k0), 0)
            if p.name == "qkv" and attn is not None:
                before["att"] = n
                h_ = ca.head_of(b, NB)
                n = n + (jnp.where(h_ < A, ca.items(pos, hd), 0) if R == 1
                         else jnp.where(h_ < A * R, ca.items(pos, hd, h_ // A, R), 0))
        return n, before

    kv_out = attn is not None and not kept  # the new k and v as an output
    names = (("table" if embed is not None else "init", "wq", "wo", "wgu", "wd")
             + (("kv", "pos", "rope") if attn is not None else ()) + (("wh",) if hp is not None else ())
             + (("token",) if embed is not None else ()) + (("state",) if kept else ())
             + ("y",) + (("kvn",) if kv_out else ()) + (("z",) if hp is not None and not greedy else ())
             + (("tokens",) if greedy else ()) + (("trace",) if trace else ()))
    # the head's few tiles a block (a greedy call's whole rows at a small vocabulary) uncapped
    head_free = greedy and -(-hp.tiles // hp.split.st) * hp.chunks <= stages

    def kernel(*refs):
        r = dict(zip(names, refs[:len(names)], strict=True))
        wq_ref, wo_ref, wgu_ref, wd_ref = (r[k] for k in ("wq", "wo", "wgu", "wd"))
        kv_ref, pos_ref, rope_ref, wh_ref = (r.get(k) for k in ("kv", "pos", "rope", "wh"))
        y_ref, kvn_ref, z_ref, trace_ref = (r.get(k) for k in ("y", "kvn", "z", "trace"))
        (x_win, w_smem, acc_smem, out_smem, norm_smem, full, free, z_smem,
         p_win, sc_smem, stage_smem, red_smem, rope_smem, rope_bar, heads_smem, lse_smem,
         best_smem, gred_smem, tok_smem, kv_written) = refs[len(names):]  # `shared_memory`'s
        b, wg = lax.axis_index("b"), lax.axis_index("wg")
        if kept:  # the words of the calls before, and this call's epoch (`plan.tag`)
            ll = r["state"]
            epoch = ll[epoch_at]
        else:
            ll, epoch = pl.get_global(plgpu.SemaphoreType.REGULAR((n_ll,))), 0
        init_ref = ll if embed is not None else r["init"]  # the host's words
        w_refs = dict(qkv=wq_ref, o=wo_ref, gu=wgu_ref, down=wd_ref)
        s = types.SimpleNamespace()  # the step's: what the phases below read (`at_step`)

        def at_position(t, base):
            """Step t's (0: a call's first, a Python int) position, epoch, items a layer and
            where each phase starts; base: its first ring step (0 or traced)."""
            first = isinstance(t, int) and t == 0
            s.t, s.base = t, base
            s.epoch = epoch if first else lax.rem(epoch + t, EPOCHS)
            s.pos = s.n_tiles = None
            if attn is not None:  # as the reference
                s.pos = jnp.clip(pos_ref[0] if first else pos_ref[0] + t, 0, S - 1)
                s.n_tiles = ca.tiles(s.pos)
            s.per_layer, s.before = counts(b, s.pos)

        def at_split():  # the step's position tiles this block reads: s.t_lo .. s.t_lo + s.n_mine - 1
            s.t_lo, s.n_mine = 0, s.n_tiles
            if attn is not None and R > 1:
                s.t_lo, t_hi = ca.split_tiles(s.n_tiles, split, R)
                s.n_mine = t_hi - s.t_lo

        if steps == 1:  # the one step's, here: read by both warpgroups
            at_position(0, 0)
        h = ca.head_of(b, NB)  # the attention block this is, if h < A R: query group h % A
        attends = h < A * R if attn is not None else None
        hg = lax.rem(h, A) if attn is not None and R > 1 else h  # its query heads hg GB ..
        split = h // A if attn is not None and R > 1 else 0  # of their positions' splits
        j_kv = hg // per_kv if attn is not None else None  # and their kv head
        if steps == 1:
            at_split()

        def ring(j):  # ring step j of the step
            return j if isinstance(s.base, int) and s.base == 0 else s.base + j

        def head_items(total):  # total and the output layer's ring steps
            if hp is None:
                return total
            active, t0, t1, k0, k1 = rect(hp, b)
            return total + jnp.where(active, (t1 - t0) * (k1 - k0), 0)

        def every_step(body, total=False):  # body() for each step; total: the ring steps after the last's
            if steps == 1:
                layers = ring(L * s.per_layer) if total else None
                body()
                return head_items(layers) if total else None

            def one(t, base):
                at_position(t, base)
                at_split()
                body()
                return head_items(ring(L * s.per_layer))
            return lax.fori_loop(0, steps, one, jnp.int32(0))

        mine = (lambda t: t) if R == 1 else (lambda t: t + s.t_lo)  # noqa: E731  (its i-th: tile mine(i))
        cap = jnp.where(attends, att_loads, loads) if uneven else loads  # weight tiles in flight at most
        n_pts = len(TRACE_POINTS)

        def tr(l, name):  # a trace point of this block (trace=True), at step s.t's layer l
            if trace:
                stamped = l if steps == 1 else s.t * L + l
                stamp(trace_ref, (b * steps * L + stamped) * n_pts + TRACE_POINTS.index(name))

        def issue(j, src, capped=True):  # ring step j: the tile src into its slot
            slot = lax.rem(j, st)
            pl.when(j >= st)(lambda: plgpu.barrier_wait(free.at[slot]))
            if (uneven or loads) and capped:  # at most `cap` tiles in flight: step j - cap has landed (0: no cap)
                x, due = rw.capped_wait(j, cap, uneven)
                pl.when(due)(lambda: plgpu.barrier_wait(full.at[lax.rem(x, st)]))
            plgpu.copy_gmem_to_smem(src, w_smem.at[slot], full.at[slot])

        def produce(l, p):  # layer l's product p: its weight tiles into the ring
            active, t0, t1, k0, k1 = rect(p, b)
            nk = k1 - k0
            n = (t1 - t0) * nk
            j0 = ring(l * s.per_layer + s.before[p.name])
            w = w_refs[p.name]

            def ahead(q):  # item q's tile asked of L2 (`prefetch`)
                t, k = t0 + q // nk, k0 + lax.rem(q, nk)
                prefetch_rows_l2(w, l * p.N + t * T, k * KC, p.K)

            @pl.when(active)
            def _():
                if prefetch:  # the product's first `prefetch` tiles, then one a step ahead
                    pl.loop(0, jnp.minimum(prefetch, n))(ahead)

                @pl.loop(0, n)
                def _(q):
                    if prefetch:
                        pl.when(q + prefetch < n)(lambda: ahead(q + prefetch))
                    t, k = t0 + q // nk, k0 + lax.rem(q, nk)
                    issue(j0 + q, w.at[l, pl.ds(t * T, T), pl.ds(k * KC, KC)])

        def produce_att(l):  # its K tiles (position tile, chunk), then V's (chunk, tile)
            j0 = ring(l * s.per_layer + s.before["att"])
            n_mine = s.n_mine

            @pl.when(attends)
            def _():
                if greedy:  # the step before wrote a row of its tiles: its consumer has (`attend`)
                    pl.when(s.t > 0)(lambda: plgpu.barrier_wait(kv_written.at[l]))

                @pl.loop(0, n_mine * nc)
                def _(q):
                    t, c = mine(q // nc), lax.rem(q, nc)
                    issue(j0 + q, kv_ref.at[l, 0, j_kv, pl.ds(t * T, T), pl.ds(c * KC, KC)])

                @pl.loop(0, n_mine * nc)
                def _(q):
                    c, t = q // n_mine, mine(lax.rem(q, n_mine))
                    issue(j0 + n_mine * nc + q, kv_ref.at[l, 1, j_kv, pl.ds(t * T, T), pl.ds(c * KC, KC)])

        def produce_head():  # the output layer's weight tiles, after the last layer's
            active, t0, t1, k0, k1 = rect(hp, b)
            nk = k1 - k0
            lag = head_free and (uneven or loads)  # the cap's waits of its ring steps, deferred

            def landed(x, when):  # ring step x's tile: waited on once, in order (the barrier's phase)
                pl.when(when & (cap > 0) if uneven else when)(lambda: plgpu.barrier_wait(full.at[lax.rem(x, st)]))

            @pl.when(active)
            def _():
                h0 = ring(L * s.per_layer)
                h1 = h0 + (t1 - t0) * nk

                @pl.loop(0, (t1 - t0) * nk)
                def _(q):
                    t, k = t0 + q // nk, k0 + lax.rem(q, nk)
                    if lag:  # step j - st, whose wait the cap would have made at step j - st + cap, before its slot is reused
                        landed(*rw.head_wait(h0, q, st, cap))
                    issue(h0 + q, wh_ref.at[pl.ds(t * T, T), pl.ds(k * KC, KC)], capped=not head_free)

                if lag:  # the deferred waits whose slots are not reused yet
                    pl.loop(*rw.head_tail(h0, h1, st, cap))(lambda x: landed(x, True))

        def consume_head():
            """x_L's chunks k0..k1-1 (`gather`: the last down's pieces and H_{L-1}, as the
            final chunks are read), then each tile's sum over them, to z at chunk group gk's piece of the
            tile: two shared buffers, a tile's TMA store in flight while the next is summed. A
            greedy call's: the tiles' best rows instead (`greedy.track`), then the block's as
            its two words (`greedy.publish`)."""
            active, t0, t1, k0, k1 = rect(hp, b)
            nk = k1 - k0

            @pl.when(active)
            def _():
                tr(L - 1, "head")
                gather(L - 1, hp, k0, k1, 0)
                tr(L - 1, "head_in")
                gk = b // hp.split.st

                @pl.loop(0, t1 - t0)
                def _(i):
                    (z,) = ring_dot(ring(L * s.per_layer + i * nk), nk, lambda kk: x_win.at[pl.ds(8 * kk, 8)])
                    buf = z_smem.at[lax.rem(i, 2)]
                    if greedy:  # (track's reads of the buffer two tiles ago ended before a barrier)
                        buf[...] = z
                        plgpu.commit_smem()
                        gr.track(buf, best_smem, (t0 + i) * T, i == 0)
                        return
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store two tiles ago read it
                    buf[...] = z
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, z_ref.at[pl.ds(gk * hp.N + (t0 + i) * T, T)])

                if greedy:  # head block b (its tile group b: one chunk group) publishes at words 2 b
                    gr.publish(best_smem, gred_smem, ll, greedy_word(lay) + 2 * b, tag(-1, s.epoch))
                else:
                    plgpu.wait_smem_to_gmem(0)
                tr(L - 1, "head_out")

        def gather(l, p, k0, k1, gt):
            """The window's rows for chunks k0..k1-1 of product p's input: two chunks a pass,
            every pass's words polled in one round trip (`product_reads`)."""
            first = l == 0
            groups, dense, norm = input_spec(p.name, l, gt, prods, lay, F, norm_eps is not None,
                                             attn is not None, norm_sums, s.epoch, R)
            if norm is not None:  # the first round also polls the norm's vector (its partials)
                dense = dict(dense, norm_ref=norm_smem, norm=(norm_eps, D), sums=norm_sums)
            for i, reads in enumerate(product_reads(p, k0, k1, words(groups))):
                poll = dict(poll_norm=(norm[0], first, norm[1], norm[2])) if norm is not None and i == 0 else {}
                pl.when(reads.chunks[0] < k1)(functools.partial(
                    cw.gather, ll, init_ref, x_win, groups, reads, out="bf16", use_init=first,
                    **dense, **poll))
            plgpu.commit_smem()  # the window's rows, for the tensor core

        def ring_steps(acc, jt, nk, b_chunk, a_transposed=False, run=None):
            """acc += the sum over ring steps jt..jt+nk-1 of slot tile (A, or its transpose)
            times b_chunk(kk) [8, 64] seen transposed (B), `inflight` + 1 products in flight:
            each step frees the slot of the step `inflight` before it if that step belongs to
            the same run of products (ring steps from `run`; None: from jt, this call's). The
            run's last `inflight` slots stay the caller's to free (`release_tail`)."""
            @pl.loop(0, nk)
            def _(kk):
                j = jt + kk
                slot = lax.rem(j, st)
                plgpu.barrier_wait(full.at[slot])
                a = w_smem.at[slot].transpose((1, 0)) if a_transposed else w_smem.at[slot]
                plgpu.wgmma(acc, a, b_chunk(kk).transpose((1, 0)))
                plgpu.wgmma_wait(inflight)  # step j - inflight's product is done: its slot is free
                release = lambda: plgpu.barrier_arrive(free.at[lax.rem(j + st - inflight, st)])  # noqa: E731
                if inflight == 1:  # the step before: this call's unless kk = 0 (then the run's, if given)
                    release() if run is not None else pl.when(kk > 0)(release)
                else:
                    pl.when(j - inflight >= (jt if run is None else run))(release)

        def release_tail(run, end):
            """After `wgmma_wait(0)`: the slots of a run's (ring steps run..end-1, end > run)
            last `inflight` steps, which `ring_steps` left."""
            plgpu.barrier_arrive(free.at[lax.rem(end - 1, st)])
            for d in range(2, inflight + 1):
                pl.when(end - d >= run)(lambda d=d: plgpu.barrier_arrive(free.at[lax.rem(end - d, st)]))

        def ring_dot(jt, nk, b_chunk, a_transposed=False, cols=1):
            """Columns 0..cols-1 of the sum over ring steps jt..jt+nk-1 (nk >= 1) of slot tile
            (A, or its transpose) times b_chunk(kk) [8, 64] seen transposed (B): [64] fp32 each."""
            def k_loop(acc):
                ring_steps(acc, jt, nk, b_chunk, a_transposed)
                plgpu.wgmma_wait(0)
                release_tail(jt, jt + nk)
                return acc[...]

            acc = pl.run_scoped(k_loop, plgpu.ACC((T, 8), jnp.float32))
            return [column(acc, g) for g in range(cols)]

        def tile_pieces(l, p, tg, count, jt, nk, gk):
            """Tiles tg .. tg + count - 1's sums over this block's nk chunks (ring steps jt..,
            tile after tile) as LL words, count <= TG (traced): one accumulator a tile, so the
            tensor core runs the tiles' products back to back, then one drain, one store to
            shared memory and one LL store for all of them (`tiles`)."""
            def body(*accs):
                for i, acc in enumerate(accs):
                    def tile(i=i, acc=acc):  # (called at once: binds this tile's values)
                        ring_steps(acc, jt + i * nk, nk, lambda kk: x_win.at[pl.ds(8 * kk, 8)],
                                   run=jt if i else None)
                    pl.when(i < count)(tile) if i else tile()

                plgpu.wgmma_wait(0)
                release_tail(jt, jt + count * nk)
                for i, acc in enumerate(accs):
                    def out(i=i, acc=acc):
                        acc_smem.at[i][...] = column(acc[...])
                    pl.when(i < count)(out) if i else out()

            pl.run_scoped(body, *[plgpu.ACC((T, 8), jnp.float32)] * TG)
            plgpu.commit_smem()
            # tile t's piece lies sk pieces (sk T words) after tile t - 1's
            cw.ll_store_rows(ll, acc_smem, piece_word(p, l, tg, gk, lay), tag(l, s.epoch), TG, p.split.sk * lay.piece_words,
                             count, packed=lay.packed)

        def consume(l, p):  # layer l's product p: its input, then its tiles' pieces, TG at a time
            active, t0, t1, k0, k1 = rect(p, b)
            nk = k1 - k0
            j0 = ring(l * s.per_layer + s.before[p.name])

            tr(l, p.name)

            @pl.when(active)
            def _():
                gather(l, p, k0, k1, b % p.split.st)
                tr(l, p.name + "_in")
                gk = b // p.split.st

                @pl.loop(0, (t1 - t0 + TG - 1) // TG)
                def _(g):
                    tg = t0 + g * TG
                    tile_pieces(l, p, tg, jnp.minimum(t1 - tg, TG), j0 + g * TG * nk, nk, gk)
                tr(l, p.name + "_out")

        def scores(j0):
            """The scores of the block's cached positions (its K tiles from ring step j0) for
            its GB query heads (B's rows), SCORE_GROUP tiles a pass: their wgmmas issued back
            to back into one accumulator each, one wait, then column g of each to sc_smem[g]."""
            G = min(SCORE_GROUP, S // T)
            n_mine = s.n_mine

            @pl.loop(0, (n_mine + G - 1) // G)
            def _(g):
                def body(*accs):
                    for i, acc in enumerate(accs):
                        t = g * G + i

                        @pl.when(t < n_mine)
                        def _(t=t, acc=acc):  # (called at once: binds this tile's values)
                            for c in range(nc):
                                slot = lax.rem(j0 + t * nc + c, st)
                                plgpu.barrier_wait(full.at[slot])
                                plgpu.wgmma(acc, w_smem.at[slot], x_win.at[pl.ds(8 * c, 8)].transpose((1, 0)))

                    plgpu.wgmma_wait(0)
                    for i, acc in enumerate(accs):
                        t = g * G + i

                        @pl.when(t < n_mine)
                        def _(t=t, acc=acc):
                            for c in range(nc):
                                plgpu.barrier_arrive(free.at[lax.rem(j0 + t * nc + c, st)])
                            a = acc[...]
                            for g in range(GB):
                                sc_smem.at[g, t][...] = column(a, g)

                pl.run_scoped(body, *[plgpu.ACC((T, 8), jnp.float32)] * G)

        def attend(l):  # query heads hg GB .. of layer l (attention.py's steps 1-6)
            j0 = ring(l * s.per_layer + s.before["att"])
            pos, n_mine, t_lo, epoch = s.pos, s.n_mine, s.t_lo, s.epoch

            @pl.when(attends)
            def _():
                tr(l, "att")
                groups, _, norm = input_spec("att", l, 0, prods, lay, F, norm_eps is not None, sums=norm_sums,
                                             epoch=epoch)
                dense, poll = {}, {}
                if norm is not None:  # the first pass also polls x_l (the norm's partials)
                    dense = dict(norm_ref=norm_smem, norm=(norm_eps, D), sums=norm_sums)
                    poll = dict(poll_norm=(norm[0], l == 0, norm[1], norm[2]))
                for i, reads in enumerate(head_reads(D, hg, hd, words(groups), H, GB)):  # q, k, v to slots
                    cw.gather(ll, init_ref, stage_smem, groups, reads, out="f32", use_init=False,
                                       **dense, **(poll if i == 0 else {}))
                tr(l, "att_in")
                if kept:  # the kv head's new k and v in the cache [L, 2, H, S, hd], row pos
                    row = ((l * 2 * H + j_kv) * S + pos) * hd
                    ca.rope_new(stage_smem, x_win, kv_ref, rope_smem, red_smem, row, row + H * S * hd, hd, GB)
                    if greedy:  # the next step's loads of the row (its producer's TMA) wait for it
                        gr.publish_kv()
                        pl.when(s.t < steps - 1)(lambda: plgpu.barrier_arrive(kv_written.at[l]))
                else:  # in kv_new [L, 2, H, hd]
                    row = (l * 2 * H + j_kv) * hd
                    ca.rope_new(stage_smem, x_win, kvn_ref, rope_smem, red_smem, row, row + H * hd, hd, GB)
                plgpu.commit_smem()  # q in the window, for the tensor core
                tr(l, "att_rope")

                scores(j0)
                plgpu.commit_smem()
                tr(l, "att_scores")
                if R == 1:
                    ca.softmax(sc_smem, p_win, red_smem, pos, s.n_tiles, scale_log2, GB)
                else:  # its positions below pos, from its first tile; the new token's only if it owns it
                    owner = split == R - 1
                    ca.softmax(sc_smem, p_win, red_smem, jnp.minimum(pos - t_lo * T, n_mine * T), n_mine,
                               scale_log2, GB, owner)
                plgpu.commit_smem()  # p in its window, for the tensor core
                tr(l, "att_softmax")
                for c in range(nc):
                    def p_v(c=c):  # (called at once: binds this chunk)
                        outs = ring_dot(j0 + n_mine * (nc + c), n_mine, lambda kk: p_win.at[pl.ds(8 * kk, 8)],
                                        a_transposed=True, cols=GB)
                        for g, o in enumerate(outs):
                            heads_smem.at[g][...] = o
                    pl.when(n_mine > 0)(p_v) if R > 1 else p_v()
                    plgpu.commit_smem()
                    if R == 1:
                        ca.combine(heads_smem, stage_smem, red_smem, (GB + 1) * hd + c * T, scale_log2, GB)
                        cw.ll_store_heads(ll, heads_smem, region(l, lay) + lay.offsets["att"] + h * GB * hd + c * T,
                                          tag(l, epoch), GB, hd)
                        continue
                    ca.combine(heads_smem, stage_smem, red_smem, (GB + 1) * hd + c * T, scale_log2, GB,
                               lse_smem, owner, n_mine == 0)
                    # query head g's chunk c is o's input chunk (hg GB + g) nc + c: split s's 64
                    # words of it at ((chunk) R + s) 64, its lse at the same words of "lse"
                    word = ((hg * GB * nc + c) * R + split) * T
                    for name, src in (("att", heads_smem), ("lse", lse_smem)):
                        cw.ll_store_rows(ll, src, region(l, lay) + lay.offsets[name] + word, tag(l, epoch), GB,
                                         nc * R * T)
                tr(l, "att_out")

        def every_phase(step, step_att):  # every layer's phases, in order
            @pl.loop(0, L)
            def _(l):
                for p in prods:
                    step(l, p)
                    if p.name == "qkv" and attn is not None:
                        step_att(l)

        @pl.when(wg == 1)
        def _producer():
            def body():
                every_phase(produce, produce_att)
                if hp is not None:
                    produce_head()
            total = every_step(body, total=True)

            @pl.loop(jnp.maximum(total - st, 0), total)
            def _(j):  # the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

        @pl.when(wg == 0)
        def _consumer():
            if trace:  # every point of this block zero, so that points never reached read 0
                zero_words(trace_ref, b * steps * L * n_pts * 2, steps * L * n_pts * 2)
            if embed is not None:  # x_0's chunk b and its square sums as the host's words
                token = jnp.clip(r["token"][0], 0, r["table"].shape[0] - 1)  # as XLA's lookup clamps
                pl.when(b < D // T)(lambda: cw.embed_words(ll, r["table"], token, b, lay.init_H,
                                                           lay.init_ss, tag(-1, epoch)))

            def body():
                if attn is not None:
                    @pl.when(attends)
                    def _():  # the angles, once a step (every layer rotates by the same ones)
                        if greedy:  # the step before's reads of them before the copy overwrites them
                            plgpu.commit_smem()
                        src = rope_ref if attn[2].ndim == 1 else rope_ref.at[s.pos]  # a table: row pos
                        plgpu.copy_gmem_to_smem(src, rope_smem, rope_bar.at[0])
                        plgpu.barrier_wait(rope_bar.at[0])

                every_phase(consume, attend)
                if hp is not None:  # first: its weights wait in the ring, y is not read before the end
                    consume_head()
                if greedy:
                    pl.when(b < D // T)(choose)
                    pl.when((s.t == steps - 1) & (b < D // T))(final)
                else:
                    pl.when(b < D // T)(final)

            def choose():  # the step's token, and the next step's x_0 chunk b from its row
                tr(L - 1, "choose")
                gr.choose(ll, greedy_word(lay), hp.split.st, tag(-1, s.epoch), gred_smem, tok_smem,
                          r["tokens"], s.t, (b == 0).astype(jnp.int32))
                tr(L - 1, "choose_in")
                pl.when(s.t < steps - 1)(lambda: cw.embed_words(
                    ll, r["table"], tok_smem[0], b, lay.init_H, lay.init_ss,
                    tag(-1, lax.rem(epoch + s.t + 1, EPOCHS))))
                tr(L - 1, "choose_out")

            def final():  # chunk b < D / 64 of x_L, to y
                groups, _, _ = input_spec("final", L - 1, 0, prods, lay, F, epoch=s.epoch)
                cw.gather(ll, init_ref, out_smem, groups, Reads((b, b), (0, 0), b + 1, 1), out="f32",
                                   use_init=0)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, y_ref.at[pl.ds(b * T, T)])
                plgpu.wait_smem_to_gmem(0)

            every_step(body)
            if kept:  # after every read of this call's epoch: the last block out advances it
                cw.close_call(ll, epoch_at, NB, pos_ref if advance else None, steps)

    scratch = shared_memory(kmax, st, TG, L, head=hp is not None, greedy=greedy,
                            attention=(S, hd, GB, R) if attn is not None else None)
    out_type = (jax.ShapeDtypeStruct((D,), jnp.float32),)
    args = (first_in, w_qkv, w_o, w_gu, w_down)
    if attn is not None:
        out_type += (jax.ShapeDtypeStruct((L, 2, H, hd), jnp.bfloat16),) if not kept else ()
        kv = jax.new_ref(attn[0]) if kept else attn[0]  # kept: the kernel writes the new k, v in it
        pos = jax.new_ref(attn[1]) if advance else attn[1]  # advance: and pos + 1
        args += (kv, pos, attn[2])
    if hp is not None:
        out_type += (jax.ShapeDtypeStruct((hp.split.sk * hp.N,), jnp.float32),) if not greedy else ()
        args += (w_head,)
    if greedy:
        out_type += (jax.ShapeDtypeStruct((steps,), jnp.int32),)
    if embed is not None:
        args += (embed[1],)
    if kept:
        state = jax.new_ref(state)
        args += (state,)
    if trace:
        out_type += (jax.ShapeDtypeStruct((NB, steps * L, len(TRACE_POINTS), 2), jnp.int32),)
    out = launch(kernel, args, out_type=out_type[0] if len(out_type) == 1 else out_type, scratch=scratch,
                 grid=(NB,), grid_names=("b",), num_threads=2, interpret=False, manual_barriers=True,
                 name="decode_chain")
    if not kept:
        return out
    out = tuple(out) if len(out_type) > 1 else (out,)
    return (*out, jax.freeze(kv), jax.freeze(state)) + ((jax.freeze(pos),) if advance else ())
