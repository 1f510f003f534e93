"""The fused decode kernels alone, per call, on a GPU: tilings of `decode_attention` beside the
unfused path they replace, and the RMSNorm kernel beside XLA's.

Each timed function runs `--chain` calls back to back inside one jit (each call reads the
cache the previous one wrote, as the layers of a decode step do), so a call's time includes
its launch and the gap to the next kernel, as in a decode step. µs per call = median over
`--reps` calls of the whole function / chain.

    python experiments/bench_decode_kernels.py --out $OUT

Shapes are the decode steps of `decode_floor.py`: 350m and 1b (16 query and 16 KV heads,
head dim 64 / 128) at batch 1 and 64, a 320-slot cache with the new token at position 288
(batch 1) or 160 (batch 64). The unfused path is RoPE of q and k in XLA, the two row writes
and the paged kernel (`LayerKVCache(fused=False)`); the fused kernel includes its split
merge. Writes `decode_kernels_<device>.json`. (The committed `decode_kernels_h200.json` was
run before the warm-up was added: its first rows, the 350m unfused path included, ran at
low clocks; whole decode steps, `decode_floor.py` variants fast@<tiling>, are the measure
the defaults were chosen by.)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gendist.inference.layer_cache import LayerKVCache
from gendist.models import layers
from gendist.timing import result_path
from pallas_kernels.decode_attention import decode_attention, default_splits
from pallas_kernels.rms_norm import rms_norm

SHAPES = {  # name: (batch, heads = kv heads, head_dim, slots, position)
    "350m_b1": (1, 16, 64, 320, 288),
    "1b_b1": (1, 16, 128, 320, 288),
    "1b_b64": (64, 16, 128, 320, 160),
}


def time_us(fn, args, chain: int, reps: int, carry: tuple = ()) -> float:
    """µs per chained call of fn(*args[:1], *carry, *args[1:]); with a `carry` (donated
    caches) each call's returned carry feeds the next."""
    def call(carry):
        out = fn(*args[:1], *carry, *args[1:])
        return out, tuple(out[1:1 + len(carry)])

    out, carry = call(carry)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out, carry = call(carry)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / chain * 1e6


def attention_fns(B, N, H, S, chain, tiling):
    """(fused, unfused) functions of (qkv, k cache, v cache, pos, cos, sin) chaining calls."""
    def fused(qkv, kc, vc, pos, cos, sin):
        acc = jnp.zeros((B, N, H), jnp.float32)
        for _ in range(chain):
            o, kc, vc = decode_attention(qkv, kc, vc, pos, cos, sin, num_heads=N, interpret=False,
                                         **tiling)
            acc = acc + o.astype(jnp.float32)
        return acc, kc, vc

    cache = LayerKVCache.create(1, B, S, N, H, jnp.bfloat16, backend="pallas", fused=False)

    def unfused(qkv, kc, vc, pos, cos, sin):
        acc = jnp.zeros((B, N, H), jnp.float32)
        q, k, v = jnp.split(qkv[:, None], [N, 2 * N], axis=2)
        for _ in range(chain):
            qr = layers.apply_rope(q, cos[:, None], sin[:, None])
            kr = layers.apply_rope(k, cos[:, None], sin[:, None])
            o, (kc, vc) = cache.attend((kc, vc), qr, kr, v, pos[:, None], 1.0 / H ** 0.5)
            acc = acc + o[:, 0].astype(jnp.float32)
        return acc, kc, vc

    donate = dict(donate_argnums=(1, 2))
    return jax.jit(fused, **donate), jax.jit(unfused, **donate)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-k", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--warm-s", type=float, default=3.0, help="matmuls first, to raise clocks")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    warm = jnp.ones((4096, 4096), jnp.bfloat16)  # an idle H200 sits at 345 MHz: warm it up
    while time.perf_counter() - t_start < args.warm_s:
        jax.block_until_ready(warm @ warm)
    res = dict(device=dev.device_kind, jax=jax.__version__, chain=args.chain, attention={},
               norm={})
    path = result_path(args.out, "decode_kernels")
    for name in args.shapes:
        B, N, H, S, p = SHAPES[name]
        ks = jax.random.split(jax.random.key(0), 3)
        qkv = jax.random.normal(ks[0], (B, 3 * N, H), jnp.bfloat16)
        pos = jnp.full((B,), p, jnp.int32)
        cos, sin = (a[:, 0] for a in layers.rope_angles(pos[:, None], H, 10000.0))

        def mk(shape=(N, B, S, H), ks=ks):  # fresh caches (the timed calls donate theirs)
            return (jax.random.normal(ks[1], shape, jnp.bfloat16),
                    jax.random.normal(ks[2], shape, jnp.bfloat16))

        rows = {}
        _, unfused = attention_fns(B, N, H, S, args.chain, {})
        rows["unfused"] = time_us(unfused, (qkv, pos, cos, sin), args.chain, args.reps, mk())
        print(name, "unfused", f"{rows['unfused']:.2f} us", flush=True)
        for bk, sp, w, st in itertools.product(args.block_k, args.splits, args.warps, args.stages):
            if time.perf_counter() - t_start > args.budget_s:
                break
            if sp and sp > -(-S // bk):
                continue
            tiling = dict(block_k=bk, num_splits=sp or None, num_warps=w, num_stages=st)
            tag = f"bk{bk}_sp{sp or 'auto' + str(default_splits(B, N, S, bk))}_w{w}_st{st}"
            try:
                fused, _ = attention_fns(B, N, H, S, args.chain, tiling)
                rows[tag] = time_us(fused, (qkv, pos, cos, sin), args.chain, args.reps, mk())
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is data
                rows[tag] = repr(e)[:300]
            print(name, tag, rows[tag], flush=True)
        best = min((v, k) for k, v in rows.items() if isinstance(v, float) and k != "unfused")
        res["attention"][name] = dict(rows=rows, best=best[1], best_us=best[0],
                                      unfused_over_best=rows["unfused"] / best[0])
        path.write_text(json.dumps(res, indent=1))
    for D in (1024, 2048):
        x = jax.random.normal(jax.random.key(1), (1, 1, D), jnp.bfloat16)
        g = jnp.ones((D,), jnp.float32)

        def chain_fn(norm, x, g):
            for _ in range(args.chain):
                s, h = norm(x, g)
                x = s + h * 1e-3  # the next call depends on this one
            return x

        xla = jax.jit(functools.partial(chain_fn, lambda x, g: (
            x + x, layers.rms_norm(x + x, g, 1e-6))))
        ker = jax.jit(functools.partial(chain_fn, lambda x, g: rms_norm(
            x, g, x, eps=1e-6, interpret=False)))
        res["norm"][str(D)] = dict(xla_us=time_us(xla, (x, g), args.chain, args.reps),
                                   kernel_us=time_us(ker, (x, g), args.chain, args.reps))
        print("add+norm", D, res["norm"][str(D)], flush=True)
    path.write_text(json.dumps(res, indent=1))
    for name, r in res["attention"].items():
        print(f"{name}: unfused {r['rows']['unfused']:.2f} us, best fused {r['best']} "
              f"{r['best_us']:.2f} us ({r['unfused_over_best']:.2f}x)")


if __name__ == "__main__":
    main()
