"""What a batch-1 decode step runs besides its layers: every kernel of one loop iteration of
greedy `generate`, in order, with its device time and the idle gap before it (median over the
middle iterations), and the step's period split into the anchor kernel, the other kernels
and idle time.

On the megakernel path the anchor is the chain kernel (`decode_chain`): everything else in a
step (the embedding row, the angles, the words' zeroing, the cache update, the final norm,
the output layer, sampling) is what the step pays on top of its layers. Run beside
`decode_floor.py` (the step's wall time) and `trace_chain.py` (the layers inside the kernel).

    python3 experiments/decode_step_timeline.py --presets 1b 350m llama3.2-1b --out $OUT

`--whole-generate [1 0]` profiles instead one default greedy `generate` whole (`generate_split`): the
prompt's kernels before the first megakernel launch (their device time, by kernel), the loop,
what follows, and the host's events around the device's span (`host_around`: where the
call's launch goes); the values choose the prompt through its kernels or through XLA
(`ChainCache.prompt_kernels`; none: the plan's). Writes `decode_generate_timeline_<device>.json`.

`--kernel-state 0 1` runs each preset also with the kernel's state kept between steps
(`decoder.plan(kernel_state=True)`: no words' zeroing, x_0's words, cache update or length
add outside the kernel), `--head fused` with the output layer inside the kernel at any
vocabulary.

The profiler adds a little to each launch, so the gaps here are upper bounds. Writes
`decode_step_timeline_<device>.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from gendist import profiling
from gendist.inference import decoder
from gendist.inference.generate import generate
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer
from gendist.presets import preset
from gendist.timing import result_path, warm_gpu

ANCHOR = {"megakernel": "decode_chain"}


def gpu_events(profile_data) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every kernel, memset and copy on the GPU streams, by start."""
    out = []
    for plane in profile_data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                out.extend((ev.name, ev.start_ns, ev.end_ns) for ev in line.events)
    return sorted(out, key=lambda e: e[1])


def iterations(events, anchor: str) -> list[list[tuple[str, int, int]]]:
    """The events from each anchor kernel's start to the next one's (the last anchor, which
    has no successor, is dropped)."""
    starts = [i for i, e in enumerate(events) if anchor in e[0]]
    return [events[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def timeline(its: list, skip: float = 0.25) -> dict:
    """Median step of the iterations (the first and last `skip` share dropped: prefill and
    the loop's exit): period, per-position kernels and the totals. Iterations whose kernel
    sequence differs from the most common one are left out (counted)."""
    n = len(its)
    lo = int(n * skip)
    hi = min(max(int(n * (1 - skip)), lo + 1), n - 1)  # each kept iteration has a successor
    names = {j: tuple(e[0] for e in its[j]) for j in range(lo, hi)}
    common = max(set(names.values()), key=list(names.values()).count)
    keep = [j for j, nm in names.items() if nm == common]
    k = len(common)
    dur = np.array([[(e[2] - e[1]) * 1e-3 for e in its[j]] for j in keep])  # us
    gap = np.array([[0.0] + [(its[j][i][1] - its[j][i - 1][2]) * 1e-3 for i in range(1, k)]
                    for j in keep])
    # the period: this anchor's start to the next one's; the tail: the last event to it
    period = np.array([(its[j + 1][0][1] - its[j][0][1]) * 1e-3 for j in keep])
    tail = np.array([(its[j + 1][0][1] - its[j][-1][2]) * 1e-3 for j in keep])
    med_d, med_g = np.median(dur, axis=0), np.median(gap, axis=0)
    rows = [{"name": common[i], "us": float(med_d[i]), "gap_before_us": float(med_g[i])}
            for i in range(k)]
    anchor_us = float(med_d[0])
    return {"iterations": len(keep), "other_sequences": len(names) - len(keep),
            "period_us": float(np.median(period)), "anchor_us": anchor_us,
            "other_kernels_us": float(med_d[1:].sum()), "kernels": k,
            "idle_us": float(med_g.sum() + np.median(tail)), "rows": rows}


def generate_split(events, anchor: str) -> dict:
    """One whole `generate` split at the anchor kernels, µs: before the first (the prompt's
    forward: its kernels, their device time and the idle between them), the loop (the
    anchors, the other kernels, idle) and after the last anchor; with the prompt's kernels in
    order (name, µs, idle before) and its device time by kernel name's kind."""
    anchors = [i for i, e in enumerate(events) if anchor in e[0]]
    first, last = anchors[0], anchors[-1]

    def part(evs, t0, t1):
        busy = sum((e[2] - e[1]) * 1e-3 for e in evs)
        return {"us": (t1 - t0) * 1e-3, "kernels": len(evs), "busy_us": busy, "idle_us": (t1 - t0) * 1e-3 - busy}

    pre = events[:first]
    loop = events[first:last + 1]
    a_us = [(e[2] - e[1]) * 1e-3 for e in loop if anchor in e[0]]
    out = {"prompt": part(pre, events[0][1], events[first][1]),
           "loop": {**part(loop, events[first][1], events[last][2]), "anchors": len(a_us),
                    "anchor_us": sum(a_us), "anchor_us_median": float(np.median(a_us))},
           "after": part(events[last + 1:], events[last][2], events[-1][2] if events[last + 1:] else events[last][2])}
    out["prompt"]["rows"] = [{"name": e[0], "us": (e[2] - e[1]) * 1e-3,
                              "gap_before_us": (e[1] - pre[i - 1][2]) * 1e-3 if i else 0.0}
                             for i, e in enumerate(pre)]
    kinds = {}
    for e in pre:
        k = re.sub(r"[._]\d+$", "", e[0].split("(")[0])
        kinds[k] = kinds.get(k, 0.0) + (e[2] - e[1]) * 1e-3
    out["prompt"]["busy_us_by_name"] = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    return out


def host_around(profile_data, t0_ns: int, t1_ns: int, top: int = 25) -> list[dict]:
    """The host's events (thread, name, start relative to t0 and duration, µs) that overlap
    [t0 - 5 ms, t0] or [t1, t1 + 5 ms] (t0, t1: the call's first and last GPU event): what the
    host does before the device starts and after it ends, the longest first."""
    out = []
    for plane in profile_data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for e in line.events:
                if (e.end_ns > t0_ns - 5_000_000 and e.start_ns < t0_ns) or (t1_ns < e.end_ns < t1_ns + 5_000_000):
                    out.append({"thread": line.name, "name": e.name[:80], "start_us": (e.start_ns - t0_ns) * 1e-3,
                                "us": e.duration_ns * 1e-3})
    return sorted(out, key=lambda r: -r["us"])[:top]


def run_generate(name: str, prompt: int, new: int, prompt_kernels: bool | None = None) -> dict:
    """The default greedy call on the megakernel path (`decoder.plan`'s defaults), profiled
    whole: `generate_split`, and the call's wall time (median of 5) beside it. prompt_kernels:
    the cache's choice for the prompt (`ChainCache.prompt_kernels`), None: the plan's."""
    cfg = preset(name).model
    params = transformer.init_params(cfg, 0)
    plan = decoder.plan(cfg, params, 1, prompt + new, "megakernel")
    tokens = jax.random.randint(jax.random.key(0), (1, prompt), 0, cfg.vocab_size)
    lens = jnp.full((1,), prompt, jnp.int32)
    cache = plan.make_cache(1, prompt + new + plan.greedy_steps - 1)
    if prompt_kernels is not None:
        cache = dataclasses.replace(cache, prompt_kernels=prompt_kernels)
    args = (plan, tokens, lens, jax.random.key(1))
    compiled = generate.lower(*args, max_new_tokens=new, sp=SamplingParams(temperature=0.0), cache=cache).compile()
    call = lambda: compiled(*args, cache=cache)  # noqa: E731
    for _ in range(2):
        jax.block_until_ready(call())
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(call())
        walls.append((time.perf_counter() - t) * 1e6)
    # the same arguments into a call that does nothing: the host's dispatch and sync alone
    noop = jax.jit(lambda plan, *a, cache: a[1] + 1).lower(*args, cache=cache).compile()
    for _ in range(3):
        jax.block_until_ready(noop(*args, cache=cache))
    noops = []
    for _ in range(20):
        t = time.perf_counter()
        jax.block_until_ready(noop(*args, cache=cache))
        noops.append((time.perf_counter() - t) * 1e6)
    with profiling.trace() as prof:
        jax.block_until_ready(call())
    events = gpu_events(prof.profile_data)
    split = generate_split(events, ANCHOR["megakernel"])
    host = host_around(prof.profile_data, events[0][1], max(e[2] for e in events))
    res = {"preset": name, "prompt_kernels": getattr(cache, "prompt_kernels", None), "host": host,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "line": plan.line, "prompt": prompt,
           "new_tokens": new, "wall_us_median": float(np.median(walls)),
           "same_arguments_noop_us_median": float(np.median(noops)), **split}
    p, lp = split["prompt"], split["loop"]
    print(f"\n{name} whole generate, prompt kernels {res['prompt_kernels']}, XLA_FLAGS {res['xla_flags']!r}: wall {res['wall_us_median']:.0f} us "
          f"(a call of nothing with its arguments: {res['same_arguments_noop_us_median']:.0f}); "
          f"prompt {p['us']:.0f} us ({p['kernels']} kernels, busy {p['busy_us']:.0f}, idle {p['idle_us']:.0f}); "
          f"loop {lp['us']:.0f} us ({lp['anchors']} launches of {lp['anchor_us_median']:.0f}, "
          f"{lp['kernels'] - lp['anchors']} other kernels, idle {lp['idle_us']:.0f}); "
          f"after {split['after']['us']:.0f} us")
    print("  prompt's device time by kernel:", {k: round(v, 1) for k, v in list(p["busy_us_by_name"].items())[:8]})
    print("  host around the device's span:", [(h["name"][:40], round(h["start_us"]), round(h["us"])) for h in host[:8]])
    return res


def fused_ops(hlo_text: str, name: str) -> str:
    """What fusion `name` computes: its fused computation's opcodes (parameters, constants and
    reshapes left out), in order, '' if not found: to tell the kernels of a step apart."""
    comps = profiling.parse_hlo(hlo_text)
    for ops in comps.values():
        for n, op, line in ops:
            if profiling._sanitize(n) == profiling._sanitize(name) and op == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", line)
                body = comps.get(called.group(1), []) if called else []
                skip = {"parameter", "constant", "bitcast", "reshape", "get-tuple-element", "tuple"}
                return " ".join(o for _, o, _ in body if o not in skip)
    return ""


def run(name: str, path: str, prompt: int, new: int, kernel_state: bool = False, head: str = "auto") -> dict:
    cfg = preset(name).model
    params = transformer.init_params(cfg, 0)
    plan = decoder.plan(cfg, params, 1, prompt + new, path, kernel_state=kernel_state, head=head)
    tokens = jax.random.randint(jax.random.key(0), (1, prompt), 0, cfg.vocab_size)
    lens = jnp.full((1,), prompt, jnp.int32)
    args = (plan, tokens, lens, jax.random.key(1))
    compiled = generate.lower(*args, max_new_tokens=new, sp=SamplingParams(temperature=0.0)).compile()
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    with profiling.trace() as prof:
        jax.block_until_ready(compiled(*args))
    events = gpu_events(prof.profile_data)
    anchor = ANCHOR.get(path)
    if anchor is None:
        raise SystemExit(f"--paths {path}: a timeline needs an anchor kernel ({sorted(ANCHOR)})")
    its = iterations(events, anchor)
    if len(its) < 4:
        raise SystemExit(f"{name} {path}: {len(its)} iterations found by the kernel name {anchor!r} "
                         f"among {len(events)} events")
    res = {"preset": name, "path": path, "kernel_state": kernel_state, "head": plan.head, "line": plan.line,
           **timeline(its)}
    hlo = compiled.as_text()
    for r in res["rows"]:
        r["ops"] = fused_ops(hlo, r["name"])
    print(f"\n{name} {path}: period {res['period_us']:.1f} us = {anchor} {res['anchor_us']:.1f} + "
          f"{res['kernels'] - 1} other kernels {res['other_kernels_us']:.1f} + idle {res['idle_us']:.1f} "
          f"({res['iterations']} steps)")
    for r in res["rows"]:
        print(f"  {r['gap_before_us']:6.2f} gap  {r['us']:8.2f} us  {r['name'][:40]:40} {r['ops'][:70]}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["1b", "350m", "llama3.2-1b"])
    ap.add_argument("--paths", nargs="+", default=["megakernel"], choices=sorted(ANCHOR))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--kernel-state", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="1: the megakernel keeps its state between steps (decoder.plan(kernel_state=True))")
    ap.add_argument("--head", default="auto", choices=["auto", "xla", "fused"], help="decoder.plan's head")
    ap.add_argument("--whole-generate", type=int, nargs="*", default=None, choices=[0, 1],
                    help="profile the default greedy generate whole instead (the prompt, the loop, after); "
                         "values: the prompt through its kernels or not (ChainCache.prompt_kernels), "
                         "none given: the plan's choice")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    if args.whole_generate is not None:
        warm_gpu()
        res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "calls": []}
        path = result_path(args.out, "decode_generate_timeline")
        for name in args.presets:
            for pk in args.whole_generate or [None]:
                res["calls"].append(run_generate(name, args.prompt, args.new_tokens, None if pk is None else bool(pk)))
                path.write_text(json.dumps(res, indent=1))
        print("wrote", path)
        return
    warm_gpu()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "prompt": args.prompt,
           "new_tokens": args.new_tokens, "runs": []}
    path = result_path(args.out, "decode_step_timeline")
    for name in args.presets:
        for p in args.paths:
            for kept in args.kernel_state:
                res["runs"].append(run(name, p, args.prompt, args.new_tokens, bool(kept), args.head))
                path.write_text(json.dumps(res, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
