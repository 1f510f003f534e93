"""What a batch-1 decode step runs besides its layers: every kernel of one loop iteration of
greedy `generate`, in order, with its device time and the idle gap before it (median over the
middle iterations), and the step's period split into the anchor kernel, the other kernels
and idle time.

On the megakernel path the anchor is the chain kernel (`decode_chain`): everything else in a
step (the embedding row, the angles, the words' zeroing, the cache update, the final norm,
the output layer, sampling) is what the step pays on top of its layers. Run beside
`decode_floor.py` (the step's wall time) and `trace_chain.py` (the layers inside the kernel).

    python3 experiments/decode_step_timeline.py --presets 1b 350m llama3.2-1b --out $OUT

`--kernel-state 0 1` runs each preset also with the kernel's state kept between steps
(`decoder.plan(kernel_state=True)`: no words' zeroing, x_0's words, cache update or length
add outside the kernel), `--head fused` with the output layer inside the kernel at any
vocabulary.

The profiler adds a little to each launch, so the gaps here are upper bounds. Writes
`decode_step_timeline_<device>.json`.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re

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


def fused_ops(hlo_text: str, name: str) -> str:
    """What fusion `name` computes: its fused computation's opcodes (parameters, constants and
    reshapes left out), in order, '' if not found: to tell the kernels of a step apart."""
    comps = profiling._parse(hlo_text)
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
    gen = jax.jit(functools.partial(generate, max_new_tokens=new, sp=SamplingParams(temperature=0.0)))
    args = (plan, tokens, lens, jax.random.key(1))
    compiled = gen.lower(*args).compile()
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
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
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
