"""Are the Mosaic GPU attention kernels (Hopper) as fast as cuDNN and tokamax, in the same run?

    export PYTHONPATH=.:$PYTHONPATH; python3 experiments/bench_attention_mgpu.py --part fa
    python3 experiments/bench_attention_mgpu.py --part paged
    python3 experiments/bench_attention_mgpu.py --smoke          # CPU: interpreter, tiny

FlashAttention (`--part fa`): bf16, batch*seq = 16384 tokens; 4k and 16k, causal and not,
16 heads, D 128; 4k and 16k causal GQA 32/8; 2k causal D 64. Ours = `flash_attention` (Mosaic GPU
on sm90), peers cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) and tokamax's
Mosaic GPU kernel (when importable: `pip install -e ".[peers]"`). FLOPs: 4*B*S^2*N*D forward, halved when causal,
x3.5 for forward+backward. Our output and gradients are compared with cuDNN's (rel. L2).

Paged decode (`--part paged`): five shapes (batch, context, heads, page), bf16, D 128; TB/s = K and V
bytes read once / median time; the ceiling is a read-only XLA sum over the same K/V pools
timed in the same run. Variants of the Mosaic kernel's tiling are timed beside the default on
every shape, and "waves": the default before the stream-K schedule (a grid of context splits in whole waves).
Writes attention_mgpu.json / paged_attention_mgpu.json to $OUT after every case, so a run cut
short keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gendist.timing import call_times, pipelined_seconds, warm_gpu
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention_mgpu import MosaicBlockSizes
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention_mgpu import PagedBlockSizes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged_attention import make_inputs  # noqa: E402

TOKENS = 16384
# (seq, causal, q heads, kv heads, head dim)
FA_CASES = [(4096, False, 16, 16, 128), (4096, True, 16, 16, 128), (16384, False, 16, 16, 128),
            (16384, True, 16, 16, 128), (4096, True, 32, 8, 128), (2048, True, 16, 16, 64),
            (16384, True, 32, 8, 128),
            # the non-causal D 128 case at other lengths, and 4k as one sequence of 64 heads
            # (the same work as case 0): which of steps a block or the batch sets a form's rate
            (8192, False, 16, 16, 128), (2048, False, 16, 16, 128), (4096, False, 64, 64, 128, 1),
            (2048, True, 16, 16, 128),  # the 1b preset's training attention, and at its batch
            (2048, True, 16, 16, 128, 24)]
# (batch, context, q heads, kv heads, page size)
PAGED_SHAPES = [(64, 4096, 32, 8, 16), (64, 4096, 32, 8, 64), (16, 16384, 32, 8, 64),
                (128, 2048, 32, 32, 64), (8, 32768, 64, 8, 16)]
# Beside the default (128-token steps, 2 stages, copies from 4 producer warps when a step
# takes >= 4 pages, one block per SM with equal shares of the work: stream-K, items split
# between blocks when the cost model says it pays): shares in whole items only ("whole"), the
# most even shares ("even"), the grid
# of the previous default (context splits in whole waves of one block per SM, `waves_sizes`),
# copies from one or two issuing threads, deeper rings of 64-token steps, Pallas's automatic
# barriers, and probes of the page stream alone (no math: not attention, rel_err shows it).
PAGED_VARIANTS = [PagedBlockSizes(split_items=False), PagedBlockSizes(split_items=True),
                  PagedBlockSizes(128, 2, issuers=1),
                  PagedBlockSizes(128, 2, issuers=2), PagedBlockSizes(64, 4), PagedBlockSizes(64, 5),
                  PagedBlockSizes(64, 4, issuers=1), PagedBlockSizes(128, 2, num_splits=4),
                  PagedBlockSizes(manual_barriers=False), PagedBlockSizes(64, 4, manual_barriers=False),
                  PagedBlockSizes(stream_only=True), PagedBlockSizes(64, 4, stream_only=True)]


def waves_sizes(batch, ctx, hkv, page, sms=132, overhead=128):
    """The default before the stream-K schedule (2026-12-01): one block per (sequence, KV
    head, split), the splits that finish soonest in whole waves of `sms` blocks, each a
    split's tokens plus `overhead` tokens' time."""
    unit = math.lcm(128, 4 * page)
    units = -(-ctx // unit)

    def cost(splits):
        per_split = -(-units // splits)
        waves = -(-batch * hkv * -(-units // per_split) // sms)
        return waves * (per_split * unit + overhead), splits

    return PagedBlockSizes(num_splits=min(cost(s) for s in range(1, units + 1))[1])


def variant_name(sizes):
    name = f"bk{sizes.block_k}_st{sizes.stages}" + {None: "", False: "_whole", True: "_even"}[sizes.split_items]
    name += "_streamonly" if sizes.stream_only else ""
    if sizes.issuers is not None:
        name += f"_iss{sizes.issuers}"
    if not sizes.manual_barriers:
        name += "_autobar"
    return name + (f"_s{sizes.num_splits}" if sizes.num_splits else "")
# The backward kernels with three stages instead of two, timed on the non-causal cases only.
ST3 = MosaicBlockSizes(stages_bwd=3)
# The kernels' new parts, each taken out in turn (same run, same cases): one block per query
# tile instead of the persistent grid, the mbarrier ping-pong instead of named barriers, the
# backward kernels with Pallas's automatic barriers.
FWD_VARIANTS = {
    "ours_grid": dict(persistent=False),
    "ours_dq_grid": dict(persistent_dq=False),  # the dQ kernel one block per tile (before)
    "ours_dkv_persistent": dict(persistent_dkv=True),  # the dK/dV kernel over key-block pairs
    "ours_mbar": dict(named_schedule=False),
    "ours_grid_mbar": dict(persistent=False, named_schedule=False),
    "ours_bwd_autobar": dict(manual_barriers_bwd=False),  # the backward with Pallas's barriers
    "ours_fused_bwd": dict(fused_bwd=True),  # dQ, dK, dV in one kernel (5 matmuls, reduce-add)
    "ours_two_kernel": dict(fused_bwd=False),  # a dQ kernel and a dK/dV kernel (7 matmuls)
    "ours_dq_bk128": dict(block_kv_dq=128),  # the dQ kernel: 128 key rows a step (wgmma N 128)
    # each kernel's last wait until its stores have landed, not only read (the default before)
    "ours_endwait_writes": dict(end_wait_reads=False),
    "ours_fused_bwd_r232": dict(fused_bwd=True, regs_bwd=232),  # 240 is the fused default
    "ours_two_kernel_r240": dict(fused_bwd=False, regs_bwd=240),
    "ours_fused_bwd_hm": dict(fused_bwd=True, dq_heads_major=True),  # dQ summed as [B, N, T, D]
    # causal: every consumer computes every step of its block (before the own-steps default)
    "ours_block_steps": dict(own_causal_steps=False),
    "ours_xla_delta": dict(delta_in_dq=False),  # delta = rowsum(dO * O) by XLA, not the dQ kernel
    "ours_steps_delta_off": dict(own_causal_steps=False, delta_in_dq=False),  # both off
    "ours_no_ds": dict(ds_in_hbm=False),  # the two-kernel (or fused) backward, not through dS in HBM
    "ours_ds": dict(ds_in_hbm=True),  # dS^T stored by the dK/dV kernel, then dQ = dS K
}


def timed(f, *args, n, pipelined: bool):
    """(seconds, output): median of `n` synchronised calls, or (`--pipelined`) `n` calls
    back to back with one synchronisation."""
    if pipelined:
        return pipelined_seconds(f, *args, n=n, warm=1)
    ts, out = call_times(f, *args, n=n, warm=1)
    return float(np.median(ts)), out


def kernel_times(f, *args):
    """The device kernels of one call of jitted `f`, from a profile: [{op, kind, us}], the
    longest first (which kernel of a backward form costs what, beside XLA's extra passes)."""
    from gendist import profiling

    compiled = f.lower(*args).compile()  # the program classified is the program profiled
    kinds = profiling.classify_hlo(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    with profiling.trace() as prof:
        jax.block_until_ready(compiled(*args))
    split = profiling.time_by_kind(prof.profile_data, kinds)
    return [dict(op=t["op"], kind=t["kind"], us=round(t["s"] * 1e6, 2)) for t in split["top_ops"][:12]]


def rel(x, ref):
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _variant(change, q, k, v, c):
    blocks = dataclasses.replace(MosaicBlockSizes.for_head_dim(q.shape[-1]), **change)
    return flash_attention(q, k, v, causal=c, block_sizes=blocks, implementation="mosaic")


def fa_impls(names, smoke):
    impls = {
        "ours": lambda q, k, v, c: flash_attention(q, k, v, causal=c),
        "cudnn": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn"),
        "ours_bwd3": lambda q, k, v, c: flash_attention(q, k, v, causal=c, block_sizes=ST3),
        "ours_triton": lambda q, k, v, c: flash_attention(q, k, v, causal=c, implementation="triton"),
    }
    for name, change in FWD_VARIANTS.items():
        impls[name] = functools.partial(_variant, change)
    if smoke:
        impls = {"ours": lambda q, k, v, c: flash_attention(q, k, v, causal=c, implementation="mosaic"),
                 "xla": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c)}
    try:
        import tokamax
        impls["tokamax_mosaic"] = lambda q, k, v, c: tokamax.dot_product_attention(
            q, k, v, is_causal=c, implementation="mosaic")
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print("no tokamax (skipped; pip install -e \".[peers]\"):", repr(e)[:200], flush=True)
    unknown = sorted(set(names or ()) - set(impls) - {"tokamax_mosaic"})  # tokamax: may be absent
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from {sorted(impls)}")
    return {k: f for k, f in impls.items() if not names or k in names}


def jitted_pair(fns: dict, name: str, fn, causal: bool):
    """(forward, gradient) of implementation `name`, jitted once per case into `fns`."""
    if name not in fns:
        def loss(q, k, v, do):  # do is an argument: not folded
            return jnp.sum(fn(q, k, v, causal).astype(jnp.float32) * do.astype(jnp.float32))

        fns[name] = (jax.jit(functools.partial(fn, c=causal)), jax.jit(jax.grad(loss, argnums=(0, 1, 2))))
    return fns[name]


def run_fa(args, res, save):
    impls = fa_impls(args.impls, args.smoke)
    cases = [(128, True, 4, 2, 64)] if args.smoke else [FA_CASES[i] for i in args.cases or range(len(FA_CASES))]
    for s, causal, n, kh, d, *batch in cases:  # batch: TOKENS // s unless the case gives it
        b = batch[0] if batch else max(1, (256 if args.smoke else TOKENS) // s)
        keys = jax.random.split(jax.random.key(s + d + n), 4)
        q, do = (jax.random.normal(kk, (b, s, n, d), jnp.bfloat16) for kk in keys[:2])
        k, v = (jax.random.normal(kk, (b, s, kh, d), jnp.bfloat16) for kk in keys[2:])
        flops = 4 * b * s * s * n * d * (0.5 if causal else 1.0)
        peer_out, rows, fns = {}, {}, {}
        # Rounds: every implementation is timed once per round, in turn, and keeps its best
        # round, so a clock or neighbour drift during the run does not favour whoever ran first.
        # --rotate: the order turns by one each round (on a power-capped card the first rounds
        # run cooler) and every implementation is compiled before the first round.
        # the three-stage backward is timed on the non-causal D 128 cases only
        names = [nm for nm in impls if not (nm == "ours_bwd3" and (causal or d != 128))]
        if args.rotate and not args.smoke:
            for name in names:
                try:
                    fwd, grad = jitted_pair(fns, name, impls[name], causal)
                    jax.block_until_ready((fwd(q, k, v), grad(q, k, v, do)))
                except Exception:  # noqa: BLE001 - recorded when timed below
                    pass
            warm_gpu(2.0)
        for rnd in range(args.rounds):
            turn = names[rnd % len(names):] + names[:rnd % len(names)] if args.rotate else names
            for name in turn:
                fn = impls[name]
                if time.time() > args.deadline:
                    print("deadline: skipping", name, s, causal, "round", rnd, flush=True)
                    continue
                row = rows.setdefault(name, dict(impl=name, B=b, S=s, N=n, K=kh, D=d, causal=causal,
                                                 fwd_ms_rounds=[], fwdbwd_ms_rounds=[]))
                if "error" in row:
                    continue
                try:
                    fwd, grad = jitted_pair(fns, name, fn, causal)
                    t, out = timed(fwd, q, k, v, n=args.iters, pipelined=args.pipelined)
                    row["fwd_ms_rounds"].append(t * 1e3)
                    t, grads = timed(grad, q, k, v, do, n=args.iters, pipelined=args.pipelined)
                    row["fwdbwd_ms_rounds"].append(t * 1e3)
                    if name not in peer_out:
                        peer_out[name] = (out, *grads)
                    if args.profile and rnd == args.rounds - 1:
                        row["fwdbwd_kernels"] = kernel_times(grad, q, k, v, do)
                    row.update(fwd_ms=min(row["fwd_ms_rounds"]), fwdbwd_ms=min(row["fwdbwd_ms_rounds"]))
                    row.update(fwd_tflops=flops / row["fwd_ms"] * 1e-9,
                               fwdbwd_tflops=3.5 * flops / row["fwdbwd_ms"] * 1e-9)
                except Exception as e:  # noqa: BLE001 - record the failure and go on
                    row["error"] = repr(e)[:400]
                print({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                       if not k_.endswith("rounds")}, flush=True)
        for row in rows.values():
            res["attention"].append(row)
        save()
        ref_name = "xla" if args.smoke else "cudnn"
        if ref_name in peer_out:  # everyone's output and gradients against cuDNN's
            for row in res["attention"]:
                if (row["S"], row["causal"], row["N"], row["D"]) != (s, causal, n, d):
                    continue
                if row["impl"] in peer_out and row["impl"] != ref_name:
                    row["rel_err_vs_" + ref_name] = [rel(x, r) for x, r in
                                                      zip(peer_out[row["impl"]], peer_out[ref_name], strict=True)]
            save()


def run_paged(args, res, save):
    shapes = [(2, 256, 8, 2, 16)] if args.smoke else PAGED_SHAPES
    head_dim = 64 if args.smoke else 128
    for shape in shapes:
        if time.time() > args.deadline:
            print("deadline: skipping", shape, flush=True)
            continue
        batch, ctx, hq, hkv, page = shape
        q, kp, vp, bt, lengths = make_inputs(*shape, head_dim=head_dim)
        kv_bytes = 2 * batch * ctx * hkv * head_dim * 2
        row = dict(B=batch, ctx=ctx, Hq=hq, Hkv=hkv, page=page, kv_GB=kv_bytes / 1e9, ours={})
        ref = jax.jit(paged_attention_reference)(q, kp, vp, bt, lengths)
        read_only = jax.jit(lambda k, v: jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32))
        sweep = {"default": None, "waves": waves_sizes(batch, ctx, hkv, page)}
        sweep.update((variant_name(v), v) for v in PAGED_VARIANTS)
        if args.paged_variants:
            sweep = {k: v for k, v in sweep.items() if k in args.paged_variants}
        if args.smoke:
            sweep = {"bk64_st2": PagedBlockSizes(64, 2), "bk64_st2_iss1": PagedBlockSizes(64, 2, issuers=1)}
        fns = {name: jax.jit(functools.partial(paged_attention, implementation="mosaic",
                                               mosaic_block_sizes=sizes))
               for name, sizes in sweep.items()}
        ro_times = []
        for rnd in range(args.paged_rounds):  # the read-only sum and every tiling once a round
            t, _ = timed(read_only, kp, vp, n=args.paged_iters, pipelined=args.pipelined)
            ro_times.append(t)
            for name, f in fns.items():
                if time.time() > args.deadline or "error" in row["ours"].get(name, {}):
                    continue
                try:
                    t, out = timed(f, q, kp, vp, bt, lengths, n=args.paged_iters, pipelined=args.pipelined)
                except Exception as e:  # noqa: BLE001
                    row["ours"][name] = dict(error=repr(e)[:400])
                    continue
                best = row["ours"].setdefault(name, dict(ms_rounds=[], rel_err=rel(out, ref)))
                best["ms_rounds"].append(t * 1e3)
                best["ms"] = min(best["ms_rounds"])
                best["TBps"] = kv_bytes / best["ms"] * 1e3 / 1e12
                if rnd == args.paged_rounds - 1:
                    print(shape, name, best, flush=True)
        t_ro = min(ro_times)
        row["xla_read_only_sum"] = dict(ms=t_ro * 1e3, TBps=kv_bytes / t_ro / 1e12,
                                        ms_rounds=[x * 1e3 for x in ro_times])
        print(shape, "xla_read_only_sum", row["xla_read_only_sum"], flush=True)
        if args.paged_triton:
            try:
                f = jax.jit(functools.partial(paged_attention, implementation="triton"))
                t, out = timed(f, q, kp, vp, bt, lengths, n=args.paged_iters, pipelined=args.pipelined)
                row["ours_triton"] = dict(ms=t * 1e3, TBps=kv_bytes / t / 1e12, rel_err=rel(out, ref))
            except Exception as e:  # noqa: BLE001
                row["ours_triton"] = dict(error=repr(e)[:400])
            print(shape, "ours_triton", row["ours_triton"], flush=True)
        ok = {k: v["TBps"] for k, v in row["ours"].items() if "TBps" in v}
        if ok and "TBps" in row["xla_read_only_sum"]:
            row["best_over_read_only"] = max(ok.values()) / row["xla_read_only_sum"]["TBps"]
        res["decode"].append(row)
        save()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("fa", "paged", "both"), default="both")
    parser.add_argument("--impls", nargs="*", default=None, help="subset of FA implementations")
    parser.add_argument("--cases", nargs="*", type=int, default=None, help="FA: indices into FA_CASES")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="FA: each implementation's best of this many turns")
    parser.add_argument("--paged-iters", type=int, default=20)
    parser.add_argument("--paged-rounds", type=int, default=1,
                        help="paged: the read-only sum and every tiling timed this many times each, in turn; best kept")
    parser.add_argument("--paged-variants", nargs="*", default=None,
                        help="subset of the paged tilings by name (default, waves, bk128_st2_whole, bk64_st4, ...)")
    parser.add_argument("--rotate", action="store_true",
                        help="FA: compile every implementation first, warm the GPU, and turn the "
                             "order of the implementations by one each round")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds before no new case starts")
    parser.add_argument("--paged-triton", action="store_true", help="also time the Triton paged kernel")
    parser.add_argument("--profile", action="store_true",
                        help="FA: also record each implementation's forward+backward kernels, profiled")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, Mosaic interpreter)")
    parser.add_argument("--pipelined", action="store_true",
                        help="time n calls back to back, one synchronisation (device time per call)")
    args = parser.parse_args()
    args.deadline = time.time() + args.budget
    out_dir = os.environ.get("OUT", ".")
    print(jax.devices(), "jax", jax.__version__, flush=True)
    if not args.smoke:
        warm_gpu(3.0)
    if args.part in ("fa", "both"):
        res = dict(jax=jax.__version__, device=str(jax.devices()[0]), attention=[])
        path = os.path.join(out_dir, "attention_mgpu.json")
        run_fa(args, res, lambda: json.dump(res, open(path, "w"), indent=1))
        summarize_fa(res["attention"])
    if args.part in ("paged", "both"):
        res = dict(jax=jax.__version__, device=str(jax.devices()[0]), decode=[])
        path = os.path.join(out_dir, "paged_attention_mgpu.json")
        run_paged(args, res, lambda: json.dump(res, open(path, "w"), indent=1))
        summarize_paged(res["decode"])


def summarize_fa(rows):
    print("\n==== TFLOP/s fwd / fwd+bwd; ours / cuDNN ====")
    for case in sorted({(r["S"], r["causal"], r["N"], r["K"], r["D"]) for r in rows}):
        at = {r["impl"]: r for r in rows if (r["S"], r["causal"], r["N"], r["K"], r["D"]) == case}
        cells = [f"{k} {r['fwd_tflops']:.0f}/{r['fwdbwd_tflops']:.0f}" if "error" not in r else f"{k} ERR"
                 for k, r in at.items()]
        o, c = at.get("ours", {}), at.get("cudnn", {})
        if "fwd_tflops" in o and "fwd_tflops" in c and "fwdbwd_tflops" in o and "fwdbwd_tflops" in c:
            cells.append(f"ratio {o['fwd_tflops'] / c['fwd_tflops']:.2f}/{o['fwdbwd_tflops'] / c['fwdbwd_tflops']:.2f}")
        print(case, " | ".join(cells))


def summarize_paged(rows):
    print("\n==== paged decode TB/s: ours (best) / read-only sum ====")
    for r in rows:
        wrong = [k for k, v in r["ours"].items() if "streamonly" not in k and v.get("rel_err", 0) > 1e-2]
        if wrong:  # a fast wrong kernel is not a result
            print(f"WRONG RESULTS (rel_err > 1e-2 against the reference): {wrong}")
        ok = {k: v["TBps"] for k, v in r["ours"].items() if "TBps" in v and k not in wrong}
        ro = r.get("xla_read_only_sum", {}).get("TBps", float("nan"))
        tr = r.get("ours_triton", {}).get("TBps", float("nan"))
        real = [v for k, v in ok.items() if "streamonly" not in k]  # probes are not attention
        best = max(real) if real else float("nan")
        print(f"{r['B']},{r['ctx']},{r['Hq']}/{r['Hkv']},{r['page']}: ours {ok}  triton {tr:.2f}  "
              f"read-only {ro:.2f}  best/read-only {best / ro:.2f}")


if __name__ == "__main__":
    main()
