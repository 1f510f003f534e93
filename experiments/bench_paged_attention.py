"""How fast does our paged decode attention read the KV cache, against JAX's own Pallas paged
op and XLA attention on a contiguous cache, in the same run (effective TB/s, one GPU)?

Bytes counted = K and V pages read once (2 * B * context * K * H * 2 for bf16); PagedAttention after Kwon et al. 2023 (vLLM). Each kernel's output is
checked against the pure-jnp reference (relative L2 error) before it is timed.

    export PYTHONPATH=.:$PYTHONPATH; python3 experiments/bench_paged_attention.py --sweep --out $OUT

Writes `bench_paged_attention.json` to --out and prints a table. Target: >= 1.5x JAX's Pallas
paged op at batch 64, context 4096, 32q/8kv heads, page 16.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from gendist.timing import median_seconds
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_chunk,
    paged_attention_chunk_reference,
    paged_attention_reference,
)

HEAD_DIM = 128
# (batch, context, q heads, kv heads, page size)
SHAPES = [(64, 4096, 32, 8, 16), (64, 4096, 32, 8, 64), (16, 16384, 32, 8, 64), (128, 2048, 32, 32, 64)]
# --sweep: every (tokens per step, warps, stages) on the first shape, then splits for the best;
# the other shapes try the first shape's top configurations.
GRID = ([dict(block_k=bk, num_warps=w, num_stages=st) for bk in (32, 64, 128) for w in (2, 4)
         for st in (2, 3, 4)]
        + [dict(block_k=bk, num_warps=8, num_stages=3) for bk in (64, 128)])
SPLITS = (1, 2, 4, 8, 16)


def variant_name(kw):
    if not kw:
        return "default"
    sp = kw.get("num_splits")
    return f"bk{kw['block_k']}_w{kw['num_warps']}_s{kw['num_stages']}_sp{sp or 'auto'}"


def bench(f, *args, n=20, warm=3):
    """Median wall time of one call, synchronised (same method as the anchors)."""
    return median_seconds(f, *args, n=n, warm=warm)


def rel_err(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def make_inputs(batch, ctx, hq, hkv, page, head_dim=HEAD_DIM, seed=0):
    """(q, K pages, V pages, block table, lengths): random bf16 pages of every sequence, full
    to `ctx` tokens, in a shuffled block table (`bench_attention_mgpu.py` uses it too)."""
    pages_per_seq = ctx // page
    total = batch * pages_per_seq
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, hq, head_dim), jnp.bfloat16)
    kp = jax.random.normal(ks[1], (hkv, total, page, head_dim), jnp.bfloat16)
    vp = jax.random.normal(ks[2], (hkv, total, page, head_dim), jnp.bfloat16)
    bt = jax.random.permutation(ks[3], total).reshape(batch, pages_per_seq).astype(jnp.int32)
    return q, kp, vp, bt, jnp.full((batch,), ctx, jnp.int32)


@functools.lru_cache(maxsize=1)
def prepare(shape):
    """Inputs of one shape and the reference output, made once for all variants."""
    q, kp, vp, bt, lengths = make_inputs(*shape)
    return q, kp, vp, bt, lengths, jax.jit(paged_attention_reference)(q, kp, vp, bt, lengths)


def run_decode(shape, variants, row=None):
    """Times our kernel in each variant (and, on a new row, the two peers) on one shape."""
    batch, ctx, hq, hkv, page = shape
    q, kp, vp, bt, lengths, ref = prepare(shape)
    kv_bytes = 2 * batch * ctx * hkv * HEAD_DIM * 2
    new_row = row is None
    if new_row:
        row = dict(B=batch, ctx=ctx, Hq=hq, Hkv=hkv, page=page, kv_GB=kv_bytes / 1e9, ours={})
    for kw in variants:
        name = variant_name(kw)
        if name in row["ours"]:
            continue
        try:
            f = jax.jit(functools.partial(paged_attention, **kw))
            err = rel_err(f(q, kp, vp, bt, lengths), ref)
            t = bench(f, q, kp, vp, bt, lengths)
            row["ours"][name] = dict(ms=t * 1e3, TBps=kv_bytes / t / 1e12, rel_err=err, config=kw)
        except Exception as e:  # a variant the compiler rejects is reported, not fatal
            row["ours"][name] = dict(error=repr(e)[:300], config=kw)
        print(shape, name, row["ours"][name], flush=True)
    if not new_row:
        return row
    q_scaled = (q.astype(jnp.float32) / np.sqrt(HEAD_DIM)).astype(q.dtype)  # JAX's op has no sm_scale
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
        f = jax.jit(lambda *a: jax_pa.paged_attention(*a, pages_per_compute_block=max(1, 128 // page)))
        err = rel_err(f(q_scaled, kp, vp, bt, lengths), ref)
        t = bench(f, q_scaled, kp, vp, bt, lengths)
        row["jax_pallas_paged"] = dict(ms=t * 1e3, TBps=kv_bytes / t / 1e12, rel_err=err)
    except Exception as e:
        row["jax_pallas_paged"] = dict(error=repr(e)[:300])
    print(shape, "jax_pallas_paged", row["jax_pallas_paged"], flush=True)
    try:  # XLA on a contiguous cache [B, ctx, K, H] holding the same tokens
        kc = kp[:, bt].reshape(hkv, batch, ctx, HEAD_DIM).transpose(1, 2, 0, 3)
        vc = vp[:, bt].reshape(hkv, batch, ctx, HEAD_DIM).transpose(1, 2, 0, 3)
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="xla")[:, 0])
        err = rel_err(f(q, kc, vc), ref)
        t = bench(f, q, kc, vc)
        row["xla_contiguous"] = dict(ms=t * 1e3, TBps=kv_bytes / t / 1e12, rel_err=err)
        del kc, vc
    except Exception as e:
        row["xla_contiguous"] = dict(error=repr(e)[:300])
    print(shape, "xla_contiguous", row["xla_contiguous"], flush=True)
    return row


def run_chunk(batch=8, ctx=4096, steps=128, hq=32, hkv=8, page=16):
    """Chunked prefill: the last `steps` tokens of each sequence attend causally to the cache."""
    q1, kp, vp, bt, lengths = make_inputs(batch, ctx, hq, hkv, page, seed=1)
    q = jax.random.normal(jax.random.key(2), (batch, steps, hq, HEAD_DIM), jnp.bfloat16)
    start = lengths - steps
    kv_bytes = 2 * batch * ctx * hkv * HEAD_DIM * 2
    flops = 4 * batch * steps * ctx * hq * HEAD_DIM
    row = dict(B=batch, ctx=ctx, T=steps, Hq=hq, Hkv=hkv, page=page)
    ref = jax.jit(paged_attention_chunk_reference)(q, kp, vp, bt, lengths, q_start_B=start)
    f = jax.jit(lambda *a: paged_attention_chunk(*a, q_start_B=start))
    try:
        err = rel_err(f(q, kp, vp, bt, lengths), ref)
        t = bench(f, q, kp, vp, bt, lengths)
        row["ours"] = dict(ms=t * 1e3, TBps=kv_bytes / t / 1e12, TFLOPs=flops / t / 1e12, rel_err=err)
    except Exception as e:
        row["ours"] = dict(error=repr(e)[:300])
    kc = kp[:, bt].reshape(hkv, batch, ctx, HEAD_DIM).transpose(1, 2, 0, 3)
    vc = vp[:, bt].reshape(hkv, batch, ctx, HEAD_DIM).transpose(1, 2, 0, 3)
    mask = (jnp.arange(ctx)[None, :] <= (ctx - steps + jnp.arange(steps))[:, None])[None, None]
    fx = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"))
    err = rel_err(fx(q, kc, vc), ref)
    t = bench(fx, q, kc, vc)
    row["xla_contiguous"] = dict(ms=t * 1e3, TBps=kv_bytes / t / 1e12, TFLOPs=flops / t / 1e12, rel_err=err)
    print("chunk", row, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", action="store_true", help="also time tuning variants")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpret mode)")
    args = parser.parse_args()
    shapes, chunk = SHAPES, {}
    if args.smoke:
        shapes, chunk = [(2, 256, 8, 2, 16)], dict(batch=2, ctx=256, steps=8, hq=8, hkv=2)
    res = dict(jax=jax.__version__, device=str(jax.devices()[0]), decode=[], chunk=None)
    path = os.path.join(args.out, "bench_paged_attention.json")

    def best(row, n=1):
        ok = sorted((v["TBps"], k) for k, v in row["ours"].items() if "TBps" in v and k != "default")
        return [row["ours"][k]["config"] for _, k in ok[::-1][:n]]

    top = []  # the first shape's best configurations, tried on the others
    for i, shape in enumerate(shapes):
        row = run_decode(shape, [{}])
        if args.sweep:
            grid = GRID if i == 0 else [kw for kw in top if kw.get("num_splits") is None]
            row = run_decode(shape, grid, row)
            (b,) = best(row)
            run_decode(shape, [dict(b, num_splits=sp) for sp in SPLITS], row)
            if i == 0:
                top = best(row, 4)
        res["decode"].append(row)
        json.dump(res, open(path, "w"), indent=1)  # partial results survive a timeout
    res["chunk"] = run_chunk(**chunk)
    json.dump(res, open(path, "w"), indent=1)

    print(f"\njax {res['jax']} on {res['device']}; TB/s = K+V bytes read once / median time")
    print(f"{'B,ctx,q/kv,page':24s} {'ours':>6s} {'best':>6s} {'jaxPal':>6s} {'XLA':>6s} "
          f"{'ours/jax':>8s} {'best/jax':>8s}  best variant")
    tb = lambda d: d.get("TBps", float("nan"))
    for r in res["decode"]:
        ok = {k: v for k, v in r["ours"].items() if "TBps" in v}
        top_name = max(ok, key=lambda k: ok[k]["TBps"]) if ok else None
        ours, jx = tb(r["ours"]["default"]), tb(r["jax_pallas_paged"])
        bst = ok[top_name]["TBps"] if top_name else float("nan")
        print(f"{r['B']},{r['ctx']},{r['Hq']}/{r['Hkv']},{r['page']:<10} {ours:6.2f} {bst:6.2f} "
              f"{jx:6.2f} {tb(r['xla_contiguous']):6.2f} {ours / jx:8.2f} {bst / jx:8.2f}  {top_name}")
    c = res["chunk"]
    print(f"chunk B={c['B']} ctx={c['ctx']} T={c['T']}: ours {c['ours']}  xla {c['xla_contiguous']}")


if __name__ == "__main__":
    main()
