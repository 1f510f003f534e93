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
`reference` is the same math in XLA; `chain_plan` holds the decomposition, the word layout
and the input wiring (CPU-testable), `chain_words` the inline-PTX word movers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import chain_words
from pallas_kernels._mgpu import (
    SMEM_LIMIT,
    WGMMA,
    launch,
    ll_store,
    sm_count,
    smem_bytes,
    tiled_smem,
)
from pallas_kernels.chain_plan import (
    KC,
    T,
    cdiv,
    init_words,
    input_spec,
    layout,
    piece_word,
    products,
    rect,
)


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
                chain_words.norm_partials(ll, init_ref, norm_smem, norm[0], first, norm[1], D)
                dense = dict(dense, norm_ref=norm_smem, norm=(norm_eps, D))
            for ps in range(cdiv(p.kmax(), 2)):
                c0 = k0 + 2 * ps
                c1 = jnp.minimum(c0 + 1, k1 - 1)
                pl.when(c0 < k1)(functools.partial(
                    chain_words.gather, ll, init_ref, x_win, groups, out="bf16", c0=c0, c1=c1, k0=k0,
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
            ll_store(ll, acc_smem, piece_word(p, l, t, gk, lay), 1, then_barrier=True)

        def consume(l, i, p):  # layer l's product p: its input, then its tiles' pieces
            active, t0, t1, k0, k1 = rect(p, b)
            nk = k1 - k0
            j0 = l * per_layer + before[i]

            @pl.when(active)
            def _():
                gather(l, p, k0, k1, b % p.split.st)
                pl.loop(t0, t1)(lambda t: tile_piece(l, p, t, j0 + (t - t0) * nk, nk, b // p.split.st))

        def every_product(step):  # step(l, i, p) for every layer's products, in order
            @pl.loop(0, L)
            def _(l):
                for i, p in enumerate(prods):
                    step(l, i, p)

        @pl.when(wg == 1)
        def _producer():
            every_product(produce)

            total = L * per_layer

            @pl.loop(jnp.maximum(total - st, 0), total)
            def _(j):  # the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

        @pl.when(wg == 0)
        def _consumer():
            every_product(consume)

            @pl.when(b < D // T)
            def _final():  # chunk b of x_L, to y
                groups, _, _ = input_spec("final", L - 1, 0, prods, lay, F)
                chain_words.gather(ll, init_ref, out_smem, groups, out="f32", c0=b, c1=b, k0=b, use_init=0)
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
