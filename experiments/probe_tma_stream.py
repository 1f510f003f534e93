"""How fast can a Mosaic GPU kernel stream weights through a TMA ring, and what does a
handover between dependent phases cost?

A batch-1 decode step is a weight stream: every matrix read once. This probe is that stream
alone: `blocks` blocks each walk their share of a matrix's [rows, kc] tiles (dealt
round-robin) through a `stages`-slot shared-memory ring, a producer warpgroup issuing the TMA
copies and a consumer warpgroup releasing the slots, after a wgmma on each tile
(`consume="wgmma"`, batch rows as A) or without one (`consume="none"`). Variants differ in
tile shape, ring depth, consumer and blocks (one or two a SM), and are timed as pipelined
calls over 1 GiB of bf16 beside XLA's read-only sum of the same matrix (all of it, and
per row: the form of a batch-1 matrix-vector product). With `phases` > 1 the stream is cut
into phases with a handover between them (a grid-wide barrier with or without fences, or
NCCL-style LL words, `mode="ll"`); price = (time - the unbroken stream) / (phases - 1). The
LL prices are what `pallas_kernels/chain`'s cost model is fitted to
(benchmarks/decode.md).

    python3 experiments/probe_tma_stream.py --out $OUT            # one H200
    python3 experiments/probe_tma_stream.py --interpret           # CPU: the code path, tiny

Writes probe_tma_stream.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(__file__))
from pallas_kernels._mgpu import (  # noqa: E402
    COL,
    WGMMA,
    fence,
    launch,
    ll_gather,
    ll_store,
    signal_relaxed,
    sm_count,
    tiled_smem,
    wait_flags,
)

_M = 64


def stream(w_NK, *, rows: int, kc: int, stages: int, blocks: int, consume: str,
           phases: int = 1, wait: str = "cons", scope: str = "sys", mode: str = "count",
           fences: str = "proxy", deps: int = 3, interpret: bool = False):
    """[blocks, 64, rows] fp32: per block the sum over its tiles of x @ tile^T (x: ones in the
    first row) with consume="wgmma", zeros with "none". Every tile of w is read once.

    phases > 1: the tiles in `phases` equal parts, a grid-wide barrier between parts as a
    decode megakernel has between dependent ops. Each block's consumer, done with its part
    (its wgmma pipeline drained), fences and adds 1 to a global semaphore; with wait="cons"
    the consumer waits for every block before its next part while the producer streams on
    (weights prefetched across the barrier), with wait="prod" the producer waits before
    copying the next part (nothing prefetched), with wait="none" nobody waits (the consumer
    still fences and signals: what that alone costs). `scope`: the wait's memory scope.
    mode="count": one grid-wide counter, every block adds 1 (so the adds meet on one word)
    and a thread polls it; mode="flags": a flag a block, each block adds 1 to its own (with
    `scope`) and the waiting warpgroup polls all flags at once, a thread a flag
    (`_mgpu.wait_flags`). fences: what the consumer runs before it signals: "proxy" (a
    proxy fence then an acquire-release fence, what a phase whose TMA stores the next phase
    reads needs), "acqrel" (the second only), "none" (nothing; the signal is still a
    release) or "relaxed" (nothing, a relaxed signal, and with
    mode="flags" no acquire fence after the wait). This probe's phases write nothing
    the next reads, so all four are correct here, and they price the fences.
    mode="ll": no barrier but data: at the end of each phase every block writes 64 values
    (its accumulator's row maxima) as low-latency words {value, phase tag}
    (`_mgpu.ll_store`), and at the start of the next its consumer waits for the 64 words of
    each of `deps` blocks (itself and the next deps - 1) and sums them into rows 1-63 of its
    wgmma operand (`_mgpu.ll_gather`), as a decode megakernel's product waits for the K
    chunks it reads from the few blocks that wrote them; no fence anywhere (wgmma consumer,
    kc 64, wait="cons" only)."""
    fence_ptxs = {"proxy": "fence.proxy.async.global; fence.acq_rel.gpu;",
                  "acqrel": "fence.acq_rel.gpu;", "none": None, "relaxed": None}
    if fences not in fence_ptxs:
        raise ValueError(f"fences={fences!r}: use one of {sorted(fence_ptxs)}.")
    fence_ptx = fence_ptxs[fences]
    if wait not in ("cons", "prod", "none"):
        raise ValueError(f"wait={wait!r}: use 'cons', 'prod' or 'none'.")
    if mode not in ("count", "flags", "ll"):
        raise ValueError(f"mode={mode!r}: use 'count', 'flags' or 'll'.")
    ll = mode == "ll" and phases > 1
    if ll and (consume != "wgmma" or kc != _M or wait != "cons" or not 0 <= deps <= blocks):
        raise ValueError(f"mode='ll' wants consume='wgmma', kc={_M}, wait='cons' and 0 <= deps "
                         f"<= blocks (0: only the stores); got {consume!r}, {kc}, {wait!r}, {deps}.")
    N, K = w_NK.shape
    tiles_n, steps_k = N // rows, K // kc
    T, NB, st, P = tiles_n * steps_k, blocks, stages, phases
    if T % P:
        raise ValueError(f"phases={P} must divide the {T} tiles.")
    Tp = T // P
    sync = P > 1

    def kernel(w_ref, out_ref, x_smem, w_smem, acc_smem, full, free, *ll_smem):
        b, wg = lax.axis_index("b"), lax.axis_index("wg")
        n = jnp.maximum(0, (Tp - b + NB - 1) // NB)  # tiles a phase, this block
        flags = mode == "flags"
        words = (P * NB * _M * 2,) if ll else (NB,) if flags else ()
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR(words)) if sync else None

        def ll_out(p, acc):  # this block's 64 values of phase p, tagged p + 1
            xin_smem, d_smem = ll_smem
            d_smem[...] = acc[...].max(axis=1)
            plgpu.commit_smem()
            ll_store(sem, d_smem, (p * NB + b) * _M, p + 1)

        def ll_in(p):  # rows 1-63 of x: the sum of phase p - 1's values of `deps` blocks
            xin_smem, _ = ll_smem
            ll_gather(sem, xin_smem, [((p - 1) * NB + lax.rem(b + d, NB)) * _M for d in range(deps)], p)
            x = plgpu.load(xin_smem, layout=COL)
            first = plgpu.broadcasted_iota(jnp.int32, (_M, kc), 0, layout=WGMMA) == 0
            x_smem[...] = jnp.where(first, 1.0, lax.broadcast_in_dim(x, (_M, kc), [1])).astype(w_NK.dtype)
            plgpu.commit_smem()

        def tile(p, i):
            t = p * Tp + b + i * NB
            return w_ref.at[pl.ds((t // steps_k) * rows, rows), pl.ds(lax.rem(t, steps_k) * kc, kc)]

        def barrier(p):  # every block done with phase p - 1
            if flags:
                wait_flags(sem, NB, p, acquire=fences != "relaxed")
            else:
                plgpu.semaphore_wait(sem, NB * p, decrement=False, memory_scope=scope)

        @pl.when(wg == 1)
        def _producer():
            @pl.loop(0, P)
            def _(p):
                if sync and wait == "prod":
                    pl.when(p > 0)(lambda: barrier(p))

                @pl.loop(0, n)
                def _(i):
                    j = p * n + i
                    slot = lax.rem(j, st)
                    pl.when(j >= st)(lambda: plgpu.barrier_wait(free.at[slot]))
                    plgpu.copy_gmem_to_smem(tile(p, i), w_smem.at[slot], full.at[slot])

            total = P * n

            @pl.loop(jnp.maximum(total - st, 0), total)
            def _(j):
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

        @pl.when(wg == 0)
        def _consumer():
            x_smem[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (_M, kc), 0) == 0, 1.0,
                                    0.0).astype(w_NK.dtype)
            plgpu.commit_smem()

            def phase_end(p, acc=None):
                if ll:
                    ll_out(p, acc)
                elif sync:
                    if fence_ptx:
                        fence(fence_ptx)
                    if fences == "relaxed":
                        signal_relaxed(sem.at[b] if flags else sem)
                    elif flags:
                        plgpu.semaphore_signal(sem.at[b], 1, memory_scope=scope)
                    else:
                        pl.semaphore_signal(sem, 1)
                    if wait == "cons":
                        pl.when(p + 1 < P)(lambda: barrier(p + 1))

            if consume == "wgmma":
                def body(acc):
                    @pl.loop(0, P)
                    def _(p):
                        if ll and deps:
                            pl.when(p > 0)(lambda: ll_in(p))

                        @pl.loop(0, n)
                        def _(i):
                            j = p * n + i
                            slot = lax.rem(j, st)
                            plgpu.barrier_wait(full.at[slot])
                            plgpu.wgmma(acc, x_smem, w_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma_wait(1)
                            pl.when(j > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(j + st - 1, st)]))

                        plgpu.wgmma_wait(0)  # the phase's products are done
                        phase_end(p, acc)

                    total = P * n
                    pl.when(total > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(total + st - 1, st)]))
                    return acc[...]

                acc_smem[...] = pl.run_scoped(body, plgpu.ACC((_M, rows), jnp.float32))
            else:
                @pl.loop(0, P)
                def _(p):
                    @pl.loop(0, n)
                    def _(i):
                        slot = lax.rem(p * n + i, st)
                        plgpu.barrier_wait(full.at[slot])
                        plgpu.barrier_arrive(free.at[slot])

                    phase_end(p)

                acc_smem[...] = jnp.zeros((_M, rows), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_smem, out_ref.at[b])
            plgpu.wait_smem_to_gmem(0)

    scratch = (tiled_smem((_M, kc), w_NK.dtype), tiled_smem((st, rows, kc), w_NK.dtype),
               plgpu.SMEM((_M, rows), jnp.float32), plgpu.Barrier(num_barriers=st),
               plgpu.Barrier(num_barriers=st))
    if ll:  # the gathered input, the values written
        scratch += (plgpu.SMEM((_M,), jnp.float32), plgpu.SMEM((_M,), jnp.float32))
    return launch(kernel, (w_NK,), out_type=jax.ShapeDtypeStruct((NB, _M, rows), jnp.float32),
                  scratch=scratch, grid=(NB,), grid_names=("b",), num_threads=2,
                  interpret=interpret, manual_barriers=True, name="tma_stream")


def parse(tag: str, sms: int) -> dict:
    """"r64_kc64_st10_wgmma_x1[_P32_cons_gpu[_flags[_none]]]": rows, kc, stages, consumer,
    blocks per SM[, phases, who waits at the barrier, the memory scope, the barrier's mode
    (count), the consumer's fences (proxy)]; mode ll takes deps instead of fences: "_ll_d3"."""
    r, kc, st, consume, per, *sync = tag.split("_")
    kw = dict(rows=int(r[1:]), kc=int(kc[2:]), stages=int(st[2:]), consume=consume,
              blocks=int(per[1:]) * sms)
    if sync:
        kw.update(phases=int(sync[0][1:]), wait=sync[1], scope=sync[2])
        if len(sync) > 3:
            kw["mode"] = sync[3]
        if len(sync) > 4 and kw["mode"] == "ll":
            kw["deps"] = int(sync[4][1:])  # "d3"
        elif len(sync) > 4:
            kw["fences"] = sync[4]
    return kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=[
        "r64_kc64_st10_wgmma_x1", "r64_kc64_st10_none_x1", "r64_kc128_st6_none_x1",
        "r64_kc256_st3_none_x1", "r64_kc64_st4_none_x1", "r64_kc64_st5_none_x2",
        "r64_kc64_st5_wgmma_x2", "r128_kc64_st6_none_x1", "r32_kc64_st16_none_x1",
        "r64_kc64_st2_none_x4"])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from gendist.timing import pipelined_seconds, warm_gpu  # noqa: PLC0415

    sms = 1 if args.interpret else sm_count()
    K = 8192
    N = 256 if args.interpret else int(args.gib * 2**30) // (2 * K)
    if args.interpret:
        K, args.variants, args.iters, args.rounds = 256, ["r64_kc64_st2_wgmma_x1", "r64_kc64_st3_none_x1"], 1, 1
    else:
        warm_gpu()
    w = jax.random.normal(jax.random.key(0), (N, K), jnp.bfloat16)
    nbytes = w.size * 2
    fns = {"xla_sum": jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32)),
           "xla_row_sums": jax.jit(lambda w: jnp.sum(w, axis=1, dtype=jnp.float32))}
    for tag in args.variants:
        kw = parse(tag, sms)
        fns[tag] = jax.jit(lambda w, kw=kw: stream(w, interpret=args.interpret, **kw))
    # The wgmma consumer's result: every block's row 0 sums its tiles; all blocks, the matrix.
    for tag in fns:
        if "wgmma" in tag:
            out = np.asarray(fns[tag](w), np.float64)
            kw = parse(tag, sms)
            wt = np.asarray(w.astype(jnp.float32), np.float64).reshape(N // kw["rows"], kw["rows"], -1)
            want = wt.sum(axis=(0, 2))  # each output column r: rows r of every row tile, all of K
            got = out[:, 0, :].sum(axis=0)
            assert np.allclose(got, want, rtol=1e-3, atol=1e-1), (tag, np.abs(got - want).max())
    best = {name: float("inf") for name in fns}
    for _ in range(args.rounds):
        for name, f in fns.items():
            best[name] = min(best[name], pipelined_seconds(f, w, n=args.iters, warm=1)[0])
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "bytes": nbytes, "sms": sms,
              "rows": [{"variant": k, "us": v * 1e6, "tbps": nbytes / v / 1e12} for k, v in best.items()]}
    for r in result["rows"]:
        print(f"{r['variant']:28s} {r['us']:9.1f} us {r['tbps']:6.2f} TB/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_tma_stream.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
