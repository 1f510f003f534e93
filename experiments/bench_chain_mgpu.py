"""The decode chain megakernel (`pallas_kernels.chain`) against the same chain in XLA and
against its floor.

For each preset's shapes (350m: D 1024, N1 3072, F 2816, 24 layers; 1b: D 2048, N1 6144,
F 5632, 22 layers), batch 1, random bf16 weights: the kernel's output against XLA's
(`pallas_kernels.chain.xla.reference`), then both timed as pipelined calls beside a read-only sum over
the same weights (the floor: weight bytes / that bandwidth). Prints and writes
bench_chain_mgpu.json to --out.

    python3 experiments/bench_chain_mgpu.py --out $OUT          # one H200
    python3 experiments/bench_chain_mgpu.py --dry --out /tmp/x  # CPU: splits and the XLA chain only
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels._mgpu import sm_count  # noqa: E402
from pallas_kernels.chain import call as cc  # noqa: E402
from pallas_kernels.chain import plan  # noqa: E402
from pallas_kernels.chain import xla as cx  # noqa: E402

PRESETS = {"350m": (1024, 3072, 2816, 24), "1b": (2048, 6144, 5632, 22)}


def weights(D, N1, F, L, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / shape[-1] ** 0.5).astype(jnp.bfloat16)

    x0 = jax.random.normal(ks[0], (D,), jnp.float32)
    return x0, w(ks[1], (L, N1, D)), w(ks[2], (L, D, D)), w(ks[3], (L, 2 * F, D)), w(ks[4], (L, D, F))


def norm_gains(L, D, seed=1):
    """RMSNorm gains near 1 for q|k|v's and gate|up's inputs, (g_attn [L, D], g_mlp [L, D]):
    the kernel takes them folded into the weights (`pallas_kernels.chain.xla.fold_norms`)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return 1 + 0.1 * jax.random.normal(k1, (L, D)), 1 + 0.1 * jax.random.normal(k2, (L, D))


def attention_inputs(L, D, capacity, pos, heads=16, seed=2):
    """(kv [L, 2, heads, capacity, hd] random bf16, pos [1], rope [hd]) and the bytes of the
    rows below pos (what a step must read)."""
    from gendist.models.layers import rope_angles  # noqa: PLC0415

    hd = D // heads
    kv = jax.random.normal(jax.random.key(seed), (L, 2, heads, capacity, hd), jnp.float32).astype(jnp.bfloat16)
    cos, sin = rope_angles(jnp.full((1, 1), pos, jnp.int32), hd, 10000.0)
    rope = jnp.concatenate([cos.reshape(-1), sin.reshape(-1)])
    return (kv, jnp.array([pos], jnp.int32), rope), L * 2 * heads * pos * hd * 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the preset's)")
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--norms", action="store_true", help="RMSNorms before q|k|v and gate|up (eps 1e-5)")
    ap.add_argument("--attention", type=int, default=0, metavar="POS",
                    help="attend (16 heads) to a random bf16 cache of POS positions (0: no attention)")
    ap.add_argument("--capacity", type=int, default=320, help="cache rows a head holds (with --attention)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry", action="store_true", help="CPU: the splits and the XLA chain only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from gendist.timing import pipelined_seconds, warm_gpu  # noqa: PLC0415

    blocks = sm_count()
    if not args.dry:
        warm_gpu()
    rows = []
    for name in args.presets:
        D, N1, F, L = PRESETS[name]
        L = args.layers or L
        prods = plan.products(D, N1, F, blocks)
        print(name, L, "layers;", ", ".join(f"{p.name} sk{p.split.sk} st{p.split.st}" for p in prods), flush=True)
        if args.dry:
            D, N1, F, L = D // 8, N1 // 8, F // 8, 2
        x0, *ws = weights(D, N1, F, L)
        nbytes = sum(w.size * 2 for w in ws)
        eps = 1e-5 if args.norms else None
        gains = norm_gains(L, D) if args.norms else None
        att, kv_bytes = (), 0
        if args.attention:
            att, kv_bytes = attention_inputs(L, D, args.capacity, args.attention)
        ref = jax.jit(functools.partial(cx.reference, norms=gains, eps=1e-5))
        want = ref(x0, *ws, *att)
        if att:
            want, want_kv = want
        want = np.asarray(want, np.float64)
        kernel_ws = list(ws)
        if gains is not None:
            kernel_ws[0], kernel_ws[2] = cx.fold_norms(ws[0], ws[2], *gains)
        row = dict(preset=name, layers=L, D=D, N1=N1, F=F, weight_bytes=nbytes, norms=args.norms,
                   attention_pos=args.attention, kv_bytes=kv_bytes,
                   predicted_us_per_layer=plan.predict_us_per_layer(D, N1, F, blocks),
                   splits={p.name: [p.split.sk, p.split.st] for p in prods})
        fns = {"xla": ref, "read_only_sum": jax.jit(lambda *ws: sum(jnp.sum(w, dtype=jnp.float32) for w in ws))}
        if not args.dry:
            ours = functools.partial(cc.chain_mgpu, stages=args.stages, norm_eps=eps)
            got = ours(x0, *kernel_ws, *att)
            if att:
                got, got_kv = got
                kv_err = np.abs(np.asarray(got_kv, np.float32) - np.asarray(want_kv, np.float32)).max()
                row["kv_new_max_abs_err"] = float(kv_err)
                print(f"  kv_new max abs err vs XLA {kv_err:.2e}", flush=True)
            got = np.asarray(got, np.float64)
            row["rel_err_vs_xla"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            print(f"  rel err vs XLA {row['rel_err_vs_xla']:.2e}", flush=True)
            fns["ours"] = ours
        best = {k: float("inf") for k in fns}
        for _ in range(1 if args.dry else args.rounds):
            for k, f in fns.items():
                a = ws if k == "read_only_sum" else (x0, *(kernel_ws if k == "ours" else ws), *att)
                best[k] = min(best[k], pipelined_seconds(f, *a, n=2 if args.dry else args.iters, warm=1)[0])
        bw = nbytes / best["read_only_sum"]
        floor = (nbytes + kv_bytes) / bw  # the weights and the cache rows below pos, once
        for k in ("xla", "ours"):
            if k in best:
                row[k] = dict(us=best[k] * 1e6, us_per_layer=best[k] * 1e6 / L,
                              tbps=nbytes / best[k] / 1e12, share_of_floor=floor / best[k])
        row["read_only_tbps"] = bw / 1e12
        rows.append(row)
        for k in ("xla", "ours"):
            if k in row:
                r = row[k]
                print(f"  {k:5s} {r['us']:9.1f} us  {r['us_per_layer']:7.2f} us/layer  {r['tbps']:5.2f} TB/s  "
                      f"{100 * r['share_of_floor']:5.1f}% of floor (read-only {bw / 1e12:.2f} TB/s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_chain_mgpu.json"), "w") as fh:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
