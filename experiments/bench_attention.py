"""How fast is our Pallas FlashAttention against its peers on one GPU, and does its memory
stay linear in the sequence length?

    PYTHONPATH=.:$PYTHONPATH python3 experiments/bench_attention.py          # on the GPU
    python3 experiments/bench_attention.py --ours triton                     # the Triton kernels on Hopper too
    python3 experiments/bench_attention.py --smoke                           # CPU, interpret

Batch*seq = 16384 tokens, 16 heads, bf16, seq 1k..16k, head dim 64 and 128, causal and
not, forward and forward+backward. Peers: XLA and cuDNN (`jax.nn.dot_product_attention`),
jax's own Pallas Triton op (`jax.experimental.pallas.ops.gpu.attention.mha`), tokamax when
importable (`pip install -e ".[peers]"`). FLOPs: 4*B*S^2*H*D forward, halved when causal, x3.5 for
forward+backward. Also compiled temp memory of forward+backward vs sequence length (ours
is linear, XLA's quadratic). Writes attention.json and attention.png to $OUT.
"ours" is `flash_attention` with `--ours` as its implementation (default: Mosaic GPU on an
sm90 GPU, Triton elsewhere). Measured on an H200 with the Triton kernels
(benchmarks/attention.md): ours >= jax Pallas forward, >= 2x it forward+backward at seq >= 4k,
head dim 128.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp

from gendist.timing import median_seconds
from pallas_kernels.flash_attention import flash_attention, mha_reference

HEADS = 16
TOKENS = 16384


ITERS = dict(n=10, warm=2)


def bench(f, *args, n=None, warm=None):
    return median_seconds(f, *args, n=n or ITERS["n"], warm=warm or ITERS["warm"])


def peers(smoke: bool, ours: str | None = None):
    """name -> fn(q, k, v, causal) over [B, S, N, H] arrays; `ours`: flash_attention's implementation."""
    impls = {"ours": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal, implementation=ours)}
    impls["xla"] = lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla")
    if smoke:
        return impls
    impls["cudnn"] = lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as pl_attn
        impls["jax_pallas"] = lambda q, k, v, causal: pl_attn.mha(
            q, k, v, None, sm_scale=1 / math.sqrt(q.shape[-1]), causal=causal)
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print("no jax pallas attention:", repr(e))
    try:
        import tokamax
        impls["tokamax_mosaic"] = lambda q, k, v, causal: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="mosaic")
    except Exception as e:  # noqa: BLE001
        print("no tokamax (skipped; pip install -e \".[peers]\"):", repr(e))
    return impls


def run_case(name, fn, q, k, v, do, causal, flops, ref):
    row = dict(impl=name, B=q.shape[0], S=q.shape[1], H=q.shape[2], D=q.shape[3], causal=causal)
    try:
        fwd = jax.jit(functools.partial(fn, causal=causal))
        out = fwd(q, k, v)
        if ref is not None:
            o32, r32 = out.astype(jnp.float32), ref.astype(jnp.float32)
            row["rel_err_vs_ours"] = float(jnp.linalg.norm(o32 - r32) / jnp.linalg.norm(r32))
        t = bench(fwd, q, k, v)
        row.update(fwd_ms=t * 1e3, fwd_tflops=flops / t / 1e12)

        def loss(q, k, v, do):  # do is an argument: a closed-over array would be constant-folded
            return jnp.sum(fn(q, k, v, causal).astype(jnp.float32) * do.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        t = bench(grad, q, k, v, do)
        row.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * flops / t / 1e12)
        return row, out
    except Exception as e:  # noqa: BLE001 - record the failure and go on
        row["error"] = repr(e)[:300]
        return row, None


def temp_memory(attention, seq, d, dtype):
    x = jax.ShapeDtypeStruct((1, seq, HEADS, d), dtype)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpret)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--seqs64", type=int, nargs="+", default=None,
                        help="sequence lengths for head dim 64 (default: --seqs)")
    parser.add_argument("--impls", nargs="+", default=None, help="subset of implementations")
    parser.add_argument("--mem-seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--mem-xla-max", type=int, default=16384, help="longest seq for XLA memory")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ours", choices=["triton", "mosaic"], default=None,
                        help="our kernels' implementation (default: Mosaic GPU on sm90, Triton elsewhere)")
    args = parser.parse_args()
    ITERS["n"] = args.iters
    tokens = 256 if args.smoke else TOKENS
    seqs = [128] if args.smoke else args.seqs
    mem_seqs = [128, 256] if args.smoke else args.mem_seqs
    impls = {k: f for k, f in peers(args.smoke, args.ours).items() if not args.impls or k in args.impls}
    res = dict(jax=jax.__version__, devices=str(jax.devices()), attention=[], memory=[])
    print(res["devices"], "jax", res["jax"], flush=True)
    out_dir = os.environ.get("OUT", "/tmp")

    def save():  # after every row, so a run cut short still leaves its figures
        with open(os.path.join(out_dir, "attention.json"), "w") as fh:
            json.dump(res, fh, indent=1)

    for i, d in enumerate(args.head_dims):
        if i == 1:
            measure_memory(res, mem_seqs, args.mem_xla_max, save)
        for s in (args.seqs64 or seqs) if d == 64 and not args.smoke else seqs:
            b = max(1, tokens // s)
            for causal in (False, True):
                keys = jax.random.split(jax.random.key(s + d), 4)
                q, k, v, do = (jax.random.normal(kk, (b, s, HEADS, d), jnp.bfloat16) for kk in keys)
                flops = 4 * b * s * s * HEADS * d * (0.5 if causal else 1.0)
                ref = None
                for name, fn in impls.items():
                    if d != 128 and name in ("xla", "tokamax_mosaic") and not args.smoke:
                        continue  # head dim 64: the fast peers only, to keep the run short
                    row, out = run_case(name, fn, q, k, v, do, causal, flops, ref)
                    if ref is None and out is not None and name == "ours":
                        ref = out  # peers are compared with ours (ours is tested vs a reference)
                    res["attention"].append(row)
                    save()
                    print({kk: (round(vv, 3) if isinstance(vv, float) else vv)
                           for kk, vv in row.items()}, flush=True)

    if len(args.head_dims) < 2:
        measure_memory(res, mem_seqs, args.mem_xla_max, save)
    save()
    summarize(res["attention"])
    plot(res, os.path.join(out_dir, "attention.png"))


def measure_memory(res, seqs, xla_max, save):
    """Compiled temp memory of causal forward+backward, B=1, 16 heads, head dim 128."""
    for s in seqs:
        for name, fn in (("ours", lambda q, k, v: flash_attention(q, k, v, causal=True)),
                         ("xla", lambda q, k, v: mha_reference(q, k, v, causal=True))):
            if name == "xla" and s > xla_max:
                continue
            try:
                mb = temp_memory(fn, s, 128, jnp.bfloat16) / 2**20
                res["memory"].append(dict(impl=name, S=s, temp_MiB=mb))
                print(f"memory {name:5s} S={s:6d} temp {mb:10.1f} MiB", flush=True)
            except Exception as e:  # noqa: BLE001
                res["memory"].append(dict(impl=name, S=s, error=repr(e)[:200]))
            save()


def summarize(rows):
    print("\n==== TFLOP/s fwd / fwd+bwd (ratio ours/peer) ====")
    cases = sorted({(r["D"], r["S"], r["causal"]) for r in rows})
    for d, s, causal in cases:
        at = {r["impl"]: r for r in rows if (r["D"], r["S"], r["causal"]) == (d, s, causal)}
        ours = at.get("ours", {})
        cells = []
        for name, r in at.items():
            if "error" in r:
                cells.append(f"{name}: ERR")
                continue
            cell = f"{name} {r['fwd_tflops']:.0f}/{r['fwdbwd_tflops']:.0f}"
            if name != "ours" and "fwd_tflops" in ours:
                cell += (f" (x{ours['fwd_tflops'] / r['fwd_tflops']:.2f}/"
                         f"x{ours['fwdbwd_tflops'] / r['fwdbwd_tflops']:.2f})")
            cells.append(cell)
        print(f"D={d} S={s:6d} causal={int(causal)} | " + " | ".join(cells))


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = [r for r in res["attention"] if "error" not in r and r["D"] == 128]
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"),
                           (axes[1], "fwdbwd_tflops", "forward+backward")):
        for name in sorted({r["impl"] for r in rows}):
            for causal, style in ((False, "-"), (True, "--")):
                pts = sorted((r["S"], r[key]) for r in rows
                             if r["impl"] == name and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{name}{' causal' if causal else ''}")
        ax.set(xscale="log", xlabel="sequence length", ylabel="TFLOP/s",
               title=f"{title}, bf16, head dim 128")
        ax.legend(fontsize=7)
    for name in ("ours", "xla"):
        pts = sorted((m["S"], m["temp_MiB"]) for m in res["memory"]
                     if m["impl"] == name and "temp_MiB" in m)
        if pts:
            axes[2].plot(*zip(*pts, strict=True), marker="o", label=name)
    axes[2].set(xscale="log", yscale="log", xlabel="sequence length",
                ylabel="compiled temp memory (MiB)", title="fwd+bwd temp memory, B=1, 16 heads")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
