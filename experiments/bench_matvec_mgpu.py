"""The decode step's weight products y = x @ w^T on one H200: the Mosaic GPU matvec
(`pallas_kernels.matvec_mgpu`) beside XLA's einsum and a read-only XLA pass over the weights.

    export PYTHONPATH=.:$PYTHONPATH; python3 experiments/bench_matvec_mgpu.py --out $OUT
    python3 experiments/bench_matvec_mgpu.py --interpret --shapes tiny   # CPU: the code path

Shapes: the decode layout [N, K] of the 350m and 1b presets' qkv, o, gate_up and down, bf16,
at batch `--batches` (1 and 8). Timed per shape and batch: (a) XLA `einsum("BK,NK->BN")`
(what the decode path runs now), (b) ours at its default block sizes, (c) ours at
`--variants` (tags n<n_tile>_kc<kc>_st<stages>[_s<splits>]; no _s: the default splits;
variants are timed at the batches in `--variant-batches`), (d) XLA's row sum of w in fp32
(reads w once: the bandwidth reference).

Timing: one jit runs `calls` products back to back, each on the next of `copies` distinct
weight copies (call i reads copy i % copies; the copies total >= `--copy-bytes`, 256 MB, five
times the 50 MB L2, so no call finds its weights in L2), each call's x passed through an
optimization barrier with the previous call's output (calls stay separate kernels, in order,
as a decode step's are). A round dispatches that jit `--iters` times back to back and
synchronises once (`gendist.timing.pipelined_seconds`' approach); µs per call = the median
round / (iters * calls). `dispatch_us` is the host's time to enqueue one jit call: when it
nears the jit's device time the numbers are host bound (flagged). TB/s = w's bytes / time.
Correctness first: each implementation's output of the last call against an fp32 einsum at
HIGHEST precision (rel. L2 error), from the timed program itself.

Writes matvec_mgpu.json to --out (default $OUT or .) after every case, so a run cut short
(--budget seconds) keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gendist import profiling
from gendist.timing import warm_gpu
from pallas_kernels.matvec_mgpu import MatvecBlockSizes, matvec_mgpu, resolve_block_sizes

SHAPES = {  # preset: {product: (N, K)}, the decode layout w [N, K]
    "350m": {"qkv": (3072, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)},
    "1b": {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)},
    "tiny": {"a": (256, 512), "b": (128, 256)},  # --interpret: Mosaic GPU's CPU interpreter
}
VARIANTS = ["n128_kc128_st4_s1", "n128_kc128_st4_s2", "n128_kc128_st4_s4", "n64_kc256_st3",
            "n64_kc128_st4", "n128_kc64_st3"]
_TAG = re.compile(r"n(\d+)_kc(\d+)_st(\d+)(?:_s(\d+))?$")


def parse_variant(tag: str) -> MatvecBlockSizes:
    m = _TAG.match(tag)
    if not m:
        raise ValueError(f"variant {tag!r}: want n<n_tile>_kc<kc>_st<stages>[_s<splits>]")
    n, kc, st, s = m.groups()
    return MatvecBlockSizes(int(n), int(kc), int(st), int(s) if s else None)


def chained(impl, calls: int):
    """jit of (x, ws) -> the `calls` products impl(x, ws[i % len(ws)]) in order, each call's x
    behind an optimization barrier with the previous call's output (no fusion, CSE or reordering
    across calls; every output is returned, so none is dead)."""
    def program(x, ws):
        outs, y, xi = [], None, x
        for i in range(calls):
            if y is not None:
                xi, y = lax.optimization_barrier((x, y))
                outs.append(y)
            y = impl(xi, ws[i % len(ws)])
        return (*outs, y)

    return jax.jit(program)


def time_program(f, args, iters: int, rounds: int):
    """(seconds per jit call: median round, host dispatch seconds per jit call, output,
    device seconds per jit call: the kernels' durations summed from a profile of one call,
    None off the GPU)."""
    out = jax.block_until_ready(f(*args))  # compile, warm
    per, dispatch = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            o = f(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(o)
        per.append((time.perf_counter() - t0) / iters)
        dispatch.append((t1 - t0) / iters)
    return float(np.median(per)), float(np.median(dispatch)), out, device_seconds(f, args)


def device_seconds(f, args):
    """The GPU's busy time for one call of f: its kernels' durations from a profile, summed.
    Wall time per call includes the gaps between kernels when the host cannot launch them as
    fast as they finish (a chain of ~10 us kernels: "HOST" in the table); a decode step's
    loop body replays as a CUDA graph, so the kernels' own durations are what it pays."""
    if jax.devices()[0].platform != "gpu":
        return None
    with profiling.trace() as t:
        jax.block_until_ready(f(*args))
    events = [d for name, _, d in profiling.device_events(t.profile_data)]
    return float(sum(events)) if events else None


def n_calls(args, w_bytes: int, copies: int) -> int:
    """Products per jit call: >= --program-bytes of weights, every copy at least once (3 when
    interpreted: the copies cycle)."""
    return copies + 1 if args.interpret else max(copies, math.ceil(args.program_bytes / w_bytes))


def device_entry(dev, calls: int, w_bytes: int) -> dict:
    """µs per call and TB/s from the profiled kernel time (nothing off the GPU)."""
    if not dev:
        return {}
    return dict(dev_us=dev / calls * 1e6, dev_TBps=w_bytes * calls / dev / 1e12)


def rel(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def run_case(args, preset, name, N, K, B, ws, read_only_row, variants):
    """One (shape, batch): every implementation's row (µs per call, TB/s, errors)."""
    dtype = ws[0].dtype
    w_bytes = N * K * jnp.dtype(dtype).itemsize
    copies = len(ws)
    calls = n_calls(args, w_bytes, copies)
    x = jax.random.normal(jax.random.key(B), (B, K), dtype)
    last = ws[(calls - 1) % copies]
    ref = jax.jit(lambda x, w: jnp.einsum("BK,NK->BN", x.astype(jnp.float32), w.astype(jnp.float32),
                                          precision=lax.Precision.HIGHEST))(x, last)
    impls = {"xla_einsum": lambda x, w: jnp.einsum("BK,NK->BN", x, w)}
    impls["ours_default"] = lambda x, w: matvec_mgpu(x, w, interpret=args.interpret)
    resolved = {"ours_default": resolve_block_sizes(x, ws[0], None)}
    for tag in variants:
        try:
            sizes = resolve_block_sizes(x, ws[0], parse_variant(tag))
        except ValueError as e:
            resolved[tag] = str(e)
            continue
        same = [k for k, v in resolved.items() if v == sizes]
        if same:  # the same kernel as one already in the list: timed once
            resolved[tag] = f"same as {same[0]}"
            continue
        resolved[tag] = sizes
        impls["ours_" + tag] = lambda x, w, s=sizes: matvec_mgpu(x, w, block_sizes=s, interpret=args.interpret)
    row = dict(preset=preset, name=name, N=N, K=K, B=B, w_MB=w_bytes / 1e6, copies=copies, calls=calls,
               impls={}, skipped={k: v for k, v in resolved.items() if isinstance(v, str)})
    for impl_name, impl in impls.items():
        if time.time() > args.deadline:
            row["skipped"][impl_name] = "deadline"
            continue
        entry = row["impls"].setdefault(impl_name, {})
        key = impl_name if impl_name in resolved else impl_name.removeprefix("ours_")
        if isinstance(resolved.get(key), MatvecBlockSizes):
            entry["block_sizes"] = resolved[key].tag
        try:
            t0 = time.perf_counter()
            t, disp, outs, dev = time_program(chained(impl, calls), (x, ws), args.iters, args.rounds)
            out = outs[-1]
            entry.update(us=t / calls * 1e6, TBps=w_bytes * calls / t / 1e12, dispatch_us=disp * 1e6,
                         program_us=t * 1e6, host_bound=disp > 0.8 * t, rel_err=rel(out, ref),
                         first_call_s=time.perf_counter() - t0, **device_entry(dev, calls, w_bytes))
        except Exception as e:  # noqa: BLE001 - record the failure and go on
            entry["error"] = repr(e)[:400]
    if read_only_row is not None:
        row["impls"]["xla_read_only"] = read_only_row
        key = "dev_TBps" if "dev_TBps" in read_only_row else "TBps"  # kernel time when profiled
        ro = read_only_row.get(key)
        for entry in row["impls"].values():
            if ro and key in entry:
                entry["over_read_only"] = entry[key] / ro
    return row


def read_only(args, ws, N, K):
    """XLA's fp32 row sum over the same copies, chained like the products: the bandwidth
    reference (B-independent: timed once per shape)."""
    w_bytes = N * K * jnp.dtype(ws[0].dtype).itemsize
    calls = n_calls(args, w_bytes, len(ws))
    impl = lambda x, w: jnp.sum(w, axis=1, dtype=jnp.float32)[None, :].astype(x.dtype) + x[:, :1]
    x = jnp.zeros((1, K), ws[0].dtype)
    try:
        t, disp, _, dev = time_program(chained(impl, calls), (x, ws), args.iters, args.rounds)
        return dict(us=t / calls * 1e6, TBps=w_bytes * calls / t / 1e12, dispatch_us=disp * 1e6,
                    program_us=t * 1e6, host_bound=disp > 0.8 * t, **device_entry(dev, calls, w_bytes))
    except Exception as e:  # noqa: BLE001
        return dict(error=repr(e)[:400])


def print_table(rows):
    print("\n==== µs per call (TB/s), kernel time from a profile on the GPU; ratio = over the read-only row sum ====")
    print(f"{'shape':<18}{'B':>3}  {'read-only':>16}  {'xla einsum':>22}  {'ours default':>22}  best variant")

    def cell(e):  # the profiled kernel time when there is one, else wall time per call
        if not e or "us" not in e:
            return "ERR" if e and "error" in e else "-"
        r = f" x{e['over_read_only']:.2f}" if "over_read_only" in e else ""
        if "dev_us" in e:
            return f"{e['dev_us']:.2f} ({e['dev_TBps']:.2f}){r}"
        return f"{e['us']:.2f} ({e['TBps']:.2f}){r}" + (" HOST" if e.get("host_bound") else "")

    for r in rows:
        im = r["impls"]
        ours = {k: v for k, v in im.items() if k.startswith("ours_") and "us" in v}
        best = min(ours, key=lambda k: ours[k].get("dev_us", ours[k]["us"])) if ours else None
        print(f"{r['preset'] + ' ' + r['name'] + ' ' + str(r['N']) + 'x' + str(r['K']):<18}{r['B']:>3}  "
              f"{cell(im.get('xla_read_only')):>16}  {cell(im.get('xla_einsum')):>22}  "
              f"{cell(im.get('ours_default')):>22}  {best} {cell(ours.get(best))}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["350m", "1b"], help="presets (or 'tiny')")
    parser.add_argument("--products", nargs="*", default=None, help="subset: qkv o gate_up down")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--variants", nargs="*", default=VARIANTS)
    parser.add_argument("--variant-batches", nargs="*", type=int, default=[1],
                        help="batches at which the variants are timed (the default at all)")
    parser.add_argument("--copy-bytes", type=float, default=256e6, help="the weight copies' total, at least")
    parser.add_argument("--program-bytes", type=float, default=512e6,
                        help="weight bytes one jit call reads, at least (more calls than copies: cycles)")
    parser.add_argument("--iters", type=int, default=5, help="jit calls per round, back to back")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is kept")
    parser.add_argument("--budget", type=float, default=140, help="seconds before no new timing starts")
    parser.add_argument("--warm-s", type=float, default=2.0)
    parser.add_argument("--interpret", action="store_true", help="Mosaic GPU's CPU interpreter (tiny shapes)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    args.deadline = time.time() + args.budget
    if args.interpret:  # a few slow interpreted calls: two copies, three calls, one round
        args.iters, args.rounds = 1, 1
    dev = jax.devices()[0]
    print(dev, "jax", jax.__version__, flush=True)
    if dev.platform == "gpu":
        warm_gpu(args.warm_s)
    res = dict(jax=jax.__version__, device=str(getattr(dev, "device_kind", dev)), args=vars(args), rows=[])
    path = os.path.join(args.out, "matvec_mgpu.json")
    os.makedirs(args.out, exist_ok=True)
    cases = [(p, n, *nk) for p in args.shapes for n, nk in SHAPES[p].items()
             if not args.products or n in args.products]
    try:
        from tqdm import tqdm
        cases_iter = tqdm(cases, desc="shapes", mininterval=5)
    except ImportError:
        cases_iter = cases
    for preset, name, N, K in cases_iter:
        if time.time() > args.deadline:
            print("deadline: skipping", preset, name, flush=True)
            continue
        w_bytes = N * K * 2
        copies = 2 if args.interpret else max(1, math.ceil(args.copy_bytes / w_bytes))
        keys = jax.random.split(jax.random.key(N + K), copies)
        make = jax.jit(lambda k, N=N, K=K: (jax.random.normal(k, (N, K), jnp.float32) / math.sqrt(K))
                       .astype(jnp.bfloat16))
        ws = tuple(make(k) for k in keys)
        ro = read_only(args, ws, N, K)
        for B in args.batches:
            row = run_case(args, preset, name, N, K, B, ws, ro,
                           args.variants if B in args.variant_batches else [])
            res["rows"].append(row)
            print(preset, name, (N, K), "B", B, {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv)
                                                    for kk, vv in v.items() if kk in ("us", "TBps", "rel_err", "error")}
                                                for k, v in row["impls"].items()}, flush=True)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
        del ws
    print_table(res["rows"])
    print("wrote", path)


if __name__ == "__main__":
    main()
