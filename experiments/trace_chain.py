"""Where a layer's time goes inside the decode chain megakernel: every block stamps
the GPU's global timer and its SM clock at `pallas_kernels.chain.kernel.TRACE_POINTS` of every layer
(`chain_mgpu(trace=True)`), and this script turns the stamps into the layer's critical path.

For each preset (norms and attention at position --pos, as a decode step at the mean position
of a 32-token prompt + 256 new tokens), layers 1 .. L-1 (layer 0 carries the ramp), median
over layers:

* per product (qkv, o, gu, down) and for the attention heads: **handover** = when the last
  block has its input minus when the last writer of that input finished (what the LL words
  cost on the critical path); **work** = the last block done minus the last block's input;
* the attention head's own steps (gather, RoPE, scores, softmax, P.V + combine + words), the
  median head, from its SM clock;
* the layer's period (the last block's q|k|v input, layer to layer);
* for q|k|v, gate|up and down, each reader's own handover (`after_sources`: its input after
  the last of the blocks it reads from), the last call's;
* with --vocab V, the output layer inside the kernel (`w_head`, a random [V, D] table): its
  handover (its last block's input after the last layer's last down piece) and its work, and
  the table's bytes over that work (the rate it was read at).

Writes trace_chain.json and
trace_<preset>_spare<0|1|auto>[_group<N>][_tiles<N>][_nosums][_unpacked][_inflight<N>][_loads<N>][_nonorms][_vocab<V>][_state].png
(a layer's timeline, block by block) to --out. --spare 0 1 auto traces the cost model's splits with o
over every block, over the blocks that do not attend, and the kernel's measured choice
(`plan.tuned`: the default), in the same process; --group N auto does the same for the query
heads an attention block takes, --tiles 1 4 for the tile pieces a block makes at a time,
--sums 0 1 for RMSNorm readers polling the vector (0) or its square sums (1, `norm_sums`, the
default), --packed 0 1 for pieces a value a word (0) or two (1, `packed`, the default),
--inflight 1 2 for the tensor-core products a block leaves running before it frees a ring slot,
--loads 0 4 auto for the weight tiles a block keeps in flight (0: the ring's free slots; auto, the
default: `plan.default_loads`),
--norms 0 1 for the chain without and with its RMSNorms (whose factors the attention's and
down's readers poll),
--state 0 1 for the kernel with fresh words each call and with the decode loop's kept state
(x_0 read from an embedding table at the kernel's start, the words and the epoch kept),
--steps N for greedy calls of N steps (`analyse`'s seams between steps; with --vocab and --state 1).

    python3 experiments/trace_chain.py --spare 0 auto --out $OUT       # one H200
    python3 experiments/trace_chain.py --presets llama3.2-1b --group 4 auto --out $OUT
    python3 experiments/trace_chain.py --presets llama3.2-1b --vocab 128256 --inflight 1 2 3 --out $OUT
    python3 experiments/trace_chain.py --presets 350m --vocab 256 --state 1 --steps 16 --out $OUT  # the seams
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_chain_mgpu import attention_inputs, weights  # noqa: E402

from gendist.presets import preset  # noqa: E402
from pallas_kernels.chain import call as cc  # noqa: E402
from pallas_kernels.chain import kernel as cm  # noqa: E402
from pallas_kernels.chain.plan import T, rect  # noqa: E402
from pallas_kernels.chain.resolve import Schedule, resolve  # noqa: E402

PRESETS = ("350m", "1b", "llama3.2-1b")
PRODUCTS = ("qkv", "o", "gu", "down")
ATT_STEPS = ("att_in", "att_rope", "att_scores", "att_softmax", "att_out")


def _relative(raw):
    """Stamps [NB, L, P, 2] int32 -> (ns [NB, L, P] float, cycles [NB, L, P] float, written
    [NB, L, P] bool), times relative to the earliest written stamp (32-bit wrap undone)."""
    raw = np.asarray(raw).astype(np.int64) & 0xFFFFFFFF
    written = raw[..., 0] != 0
    t0 = raw[..., 0][written].min()
    ns = ((raw[..., 0] - t0 + 2**31) % 2**32) - 2**31  # within +-2 s of t0
    c0 = raw[:, :, :, 1][written].min()
    cyc = ((raw[..., 1] - c0 + 2**31) % 2**32) - 2**31
    return ns.astype(float), cyc.astype(float), written


def analyse(raw, L: int, steps: int = 1) -> dict:
    """raw: a call's stamps [NB, steps L, P, 2] (step t's layer l at t L + l). The layers'
    medians over every step's layers 1 .. L-1; with steps > 1 also the seams between steps
    (`seam_us`, median over them): the output layer's handover and work, the choice's
    handover (its last block's token after the last head block's end) and work (x_0's words
    written), layer 0's q|k|v handover after them, and the seam's period (layer 0's q|k|v
    input after layer L-1's, against a layer's `period`)."""
    ns, cyc, written = _relative(raw)
    LT = steps * L
    idx = {n: i for i, n in enumerate(cm.TRACE_POINTS)}
    t = lambda name: ns[:, :, idx[name]]  # noqa: E731
    ok = lambda name: written[:, :, idx[name]]  # noqa: E731

    def last(name, l):
        w = ok(name)[:, l]
        return t(name)[w, l].max() if w.any() else np.nan

    # SM clock rate: each block's cycles over its nanoseconds, first to last stamp
    rates = []
    for b in range(ns.shape[0]):
        w = written[b]
        if w.sum() > 2:
            span_ns = ns[b][w].max() - ns[b][w].min()
            span_cyc = cyc[b][w].max() - cyc[b][w].min()
            if span_ns > 0:
                rates.append(span_cyc / span_ns)
    ghz = float(np.median(rates))
    layers, seams = [], []
    for l in range(1, LT):
        if l % L == 0:  # layer 0 of the step after a seam
            e = l - 1
            seams.append(dict(head_handover=last("head_in", e) - last("down_out", e),
                              head_work=last("head_out", e) - last("head_in", e),
                              choose_handover=last("choose_in", e) - last("head_out", e),
                              choose_work=last("choose_out", e) - last("choose_in", e),
                              qkv_handover=last("qkv_in", l) - last("choose_out", e),
                              period=last("qkv_in", l) - last("qkv_in", e)))
            continue
        row = {}
        prev_done = last("down_out", l - 1)
        for p in PRODUCTS:
            src_done = prev_done
            if p == "o" and ok("att_out")[:, l].any():
                src_done = last("att_out", l)
            row[p + "_handover"] = last(p + "_in", l) - src_done
            row[p + "_work"] = last(p + "_out", l) - last(p + "_in", l)
            prev_done = last(p + "_out", l)
            if p == "qkv" and ok("att_out")[:, l].any():
                row["att_handover"] = last("att_in", l) - last("qkv_out", l)
                row["att_work"] = last("att_out", l) - last("att_in", l)
        if l + 1 < LT and (l + 1) % L:
            row["period"] = last("qkv_in", l + 1) - last("qkv_in", l)
        layers.append(row)
    keys = sorted({k for r in layers for k in r})
    median = {k: float(np.nanmedian([r.get(k, np.nan) for r in layers])) / 1e3 for k in keys}
    att_steps = {}
    heads = written[:, :, idx["att_out"]]
    if heads.any():
        prev = "att"
        for s in ATT_STEPS:  # the median head's step, in SM cycles -> us
            d = (cyc[:, :, idx[s]] - cyc[:, :, idx[prev]])[:, 1:][heads[:, 1:]]
            att_steps[s] = float(np.median(d)) / ghz / 1e3
            prev = s
    total = ns[written].max() - ns[written].min()
    head = {}
    if ok("head_out")[:, LT - 1].any():  # the output layer, after the last layer
        head = dict(handover=(last("head_in", LT - 1) - last("down_out", LT - 1)) / 1e3,
                    work=(last("head_out", LT - 1) - last("head_in", LT - 1)) / 1e3)
    seam = {k: float(np.nanmedian([r[k] for r in seams])) / 1e3 for k in (seams[0] if seams else ())}
    return dict(us_per_layer_median=median, attention_steps_us=att_steps, sm_ghz=ghz,
                kernel_us_from_stamps=float(total) / 1e3, head_us=head, seam_us=seam)


def writers(p) -> dict:
    """Tile t of product p -> the blocks that write its pieces (`plan.rect`)."""
    out = {}
    for b in range(p.split.sk * p.split.st):
        _, t0, t1, _, _ = rect(p, b)
        for t in range(t0, t1):
            out.setdefault(t, []).append(b)
    return out


def after_sources(raw, L: int, prods) -> dict:
    """For q|k|v, gate|up and down, each reader block's own handover: its input stamp minus
    the last finish among the blocks that write the pieces it reads (the previous down's,
    o's, gate|up's gate and up tiles; the dense vectors beside them are written earlier).
    Median over blocks and layers 1 .. L-2 (µs); the share of readers that began to poll
    only after their sources had finished, and those readers' median gather (input stamp
    minus their product's start: the poll alone, with every word already written)."""
    ns, _, written = _relative(raw)
    idx = {n: i for i, n in enumerate(cm.TRACE_POINTS)}
    qkv, o, gu, down = prods
    F_tiles = gu.N // 2 // T  # gate's tiles; up's follow
    cases = dict(qkv=(qkv, down, -1, ()), gu=(gu, o, 0, ()), down=(down, gu, 0, (F_tiles,)))
    out = {}
    for name, (p, src, dl, offsets) in cases.items():
        w = writers(src)
        gaps, late, alone = [], [], []
        for l in range(1, L - 1):
            for b in range(p.split.sk * p.split.st):
                _, _, _, k0, k1 = rect(p, b)
                blocks = {s for c in range(k0, k1) for off in (0, *offsets) for s in w[c + off]}
                if not written[b, l, idx[name + "_in"]]:
                    continue
                ready = max(ns[s, l + dl, idx[src.name + "_out"]] for s in blocks)
                start, got = ns[b, l, idx[name]], ns[b, l, idx[name + "_in"]]
                gaps.append(got - ready)
                late.append(start >= ready)
                if late[-1]:
                    alone.append(got - start)
        out[name] = dict(input_after_sources_us=float(np.median(gaps)) / 1e3,
                         polled_after_sources=float(np.mean(late)),
                         gather_alone_us=float(np.median(alone)) / 1e3 if alone else float("nan"))
    return out


def plot(raw, L: int, path: str, title: str):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ns, _, written = _relative(raw)
    idx = {n: i for i, n in enumerate(cm.TRACE_POINTS)}
    l = L // 2
    colours = dict(qkv="tab:blue", o="tab:orange", gu="tab:green", down="tab:red", att="tab:purple")
    fig, ax = plt.subplots(figsize=(11, 6))
    t_min = ns[:, l][written[:, l]].min()
    for b in range(ns.shape[0]):
        for p in (*PRODUCTS, "att"):
            start, inp, done = (p, p + "_in", p + "_out")
            if not written[b, l, idx[done]]:
                continue
            s, i, d = (ns[b, l, idx[n]] - t_min for n in (start, inp, done))
            ax.barh(b, (i - s) / 1e3, left=s / 1e3, color=colours[p], alpha=0.25, height=1.0)
            ax.barh(b, (d - i) / 1e3, left=i / 1e3, color=colours[p], height=1.0)
    from matplotlib.patches import Patch  # noqa: PLC0415

    ax.legend(handles=[Patch(color=c, label=p) for p, c in colours.items()], loc="upper right")
    ax.set_xlabel("us from the layer's first stamp (light: waiting for the input, dark: working)")
    ax.set_ylabel("block")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--spare", nargs="+", default=["auto"], choices=["auto", "0", "1"],
                    help="1: o on the blocks that do not attend; 0: on every block; auto: the "
                         "kernel's measured choice for the shape (its splits too)")
    ap.add_argument("--group", nargs="+", default=["auto"],
                    help="query heads an attention block takes (grouped-query attention), each "
                         "traced: a number, or auto (the kernel's choice: measured, else "
                         "attention.default_group)")
    ap.add_argument("--tiles", nargs="+", type=int, default=[1],
                    help="tile pieces a block makes at a time (chain_mgpu's tiles), each traced")
    ap.add_argument("--sums", nargs="+", type=int, default=[1], choices=[0, 1],
                    help="1 (the kernel's default): RMSNorm readers poll the vector's square sums "
                         "(chain_mgpu's norm_sums); 0: the whole vector; each traced")
    ap.add_argument("--packed", nargs="+", type=int, default=[1], choices=[0, 1],
                    help="1 (the kernel's default): the pieces two values a word (chain_mgpu's "
                         "packed); 0: one; each traced")
    ap.add_argument("--inflight", nargs="+", type=int, default=[1],
                    help="tensor-core products a block leaves running before it frees a ring slot "
                         "(chain_mgpu's inflight), each traced")
    ap.add_argument("--loads", nargs="+", type=lambda s: None if s == "auto" else int(s), default=[None],
                    help="weight tiles a block keeps in flight at most (chain_mgpu's loads; 0: "
                         "as many as the ring's free slots; auto: the default for the width), each traced")
    ap.add_argument("--norms", nargs="+", type=int, default=[1], choices=[0, 1],
                    help="1: the RMSNorms (their factors polled by the attention's and down's "
                         "readers); 0: the chain without them (norm_eps=None); each traced")
    ap.add_argument("--state", nargs="+", type=int, default=[0], choices=[0, 1],
                    help="1: the kernel keeps its state from call to call and reads x_0 from an "
                         "embedding table (chain_mgpu(state=..., embed=...), the decode loop's kept form)")
    ap.add_argument("--vocab", type=int, default=0,
                    help="with V > 0, the output layer inside the kernel: a random [V, D] table")
    ap.add_argument("--steps", type=int, default=1,
                    help="N > 1: greedy calls of N steps (chain_mgpu(steps=N); needs --vocab and "
                         "--state 1, the vocabulary's table as the embedding), every step traced "
                         "and the seams between steps measured")
    ap.add_argument("--pos", type=int, default=160)
    ap.add_argument("--capacity", type=int, default=320)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.steps > 1 and (not args.vocab or args.state != [1] or args.norms != [1]):
        ap.error(f"--steps {args.steps}: greedy steps need the output layer and the kept state: "
                 "pass --vocab V --state 1 (and the norms)")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, spare, group, tiles, sums, packed, inflight, loads, norms, kept in (
            (n, s, g, t, u, k, i, c, m, e) for n in args.presets for s in args.spare for g in args.group
            for t in args.tiles for u in args.sums for k in args.packed for i in args.inflight
            for c in args.loads for m in args.norms for e in args.state):
        m = preset(name).model
        D, F, L, K = m.d_model, m.d_ff, m.num_layers, m.num_kv_heads
        x0, *ws = weights(D, D + 2 * K * m.head_dim, F, L)  # q|k|v rows: q, then K heads of k and v
        (kv, *att), _ = attention_inputs(L, D, args.capacity, args.pos, m.num_heads)
        att = (kv[:, :, :K], *att)
        sched = Schedule(stages=args.stages, tiles=tiles, inflight=inflight, loads=loads, norm_sums=bool(sums),
                         packed=bool(packed), trace=True)
        kw = {} if spare == "auto" else dict(spare=spare == "1", splits=())  # what the kernel runs
        if group != "auto":
            kw["group"] = int(group)
        w_head = (jax.random.normal(jax.random.key(3), (args.vocab, D), jnp.float32).astype(jnp.bfloat16)
                  if args.vocab else None)
        kw["norm_eps"] = 1e-5 if norms else None
        if kept and args.steps > 1:  # the head's table is the embedding; the steps choose from it
            kw["embed"] = (w_head, jnp.array([7], jnp.int32))
        elif kept:  # x_0 is row 7 of a table; the state goes from each call to the next
            kw["embed"] = (x0.astype(jnp.bfloat16)[None].repeat(8, 0), jnp.array([7], jnp.int32))
        greedy = dict(steps=args.steps, advance=True) if args.steps > 1 else {}
        opts = {**sched._asdict(), **kw, **greedy}  # chain_mgpu's keywords
        x0_in, state = ((None, jnp.zeros((cc.state_size(None, *ws, *att, w_head=w_head, **opts),), jnp.int32))
                        if kept else (x0, None))
        f = jax.jit(lambda state, w_head, *a, opts=opts: cc.chain_mgpu(*a, state=state, w_head=w_head, **opts))
        results = []
        for _ in range(args.calls + 1):  # the first compiles
            out = f(state, w_head, x0_in, *ws, *att)
            if greedy:  # (..., trace, state, pos + steps): each call decodes from the same pos
                *out, state, _ = out
            elif kept:
                *out, state = out
            results.append(analyse(jax.device_get(out[-1]), L, args.steps))
        raw = jax.device_get(out[-1])
        results = results[1:]
        ran = resolve(x0_in, *ws, *att, sched, w_head=w_head, kept=kept, steps=args.steps, **kw)  # its products and loads
        sources = after_sources(raw, L, ran.prods)  # the last call's
        keys = results[0]["us_per_layer_median"].keys()
        med = {k: float(np.median([r["us_per_layer_median"][k] for r in results])) for k in keys}
        att_steps = {k: float(np.median([r["attention_steps_us"][k] for r in results]))
                     for k in results[0]["attention_steps_us"]}
        head_us = {k: float(np.median([r["head_us"][k] for r in results])) for k in results[0]["head_us"]}
        seam_us = {k: float(np.median([r["seam_us"][k] for r in results])) for k in results[0]["seam_us"]}
        if head_us:
            head_us["table_TBps"] = args.vocab * D * 2 / head_us["work"] / 1e6
        row = dict(preset=name, spare=spare, group=group, tiles=tiles, sums=sums, packed=packed, inflight=inflight,
                   loads=ran.sched.loads, norms=norms, state=kept, sources=sources,
                   vocab=args.vocab, layers=L, pos=args.pos, stages=args.stages, calls=args.calls,
                   steps=args.steps, us_per_layer_median=med, attention_steps_us=att_steps, head_us=head_us,
                   seam_us=seam_us,
                   kernel_us_from_stamps=[r["kernel_us_from_stamps"] for r in results],
                   sm_ghz=results[-1]["sm_ghz"])
        rows.append(row)
        print(f"{name} (spare={spare}, group={group}, tiles={tiles}, sums={sums}, packed={packed}, "
              f"inflight={inflight}, loads={ran.sched.loads}, norms={norms}, state={kept}): {L} layers, pos {args.pos}; kernel (stamps) "
              f"{np.median(row['kernel_us_from_stamps']):.1f} us; SM {row['sm_ghz']:.2f} GHz", flush=True)
        for k in ("qkv", "att", "o", "gu", "down"):
            if k + "_work" in med:
                print(f"  {k:5s} handover {med[k + '_handover']:6.2f} us   work {med[k + '_work']:6.2f} us")
        print(f"  period {med.get('period', float('nan')):6.2f} us a layer")
        print("  a reader's input after its own sources (median us; share that began to poll after them): "
              + ", ".join(f"{k} {v['input_after_sources_us']:.2f} ({v['polled_after_sources']:.0%}; "
                          f"their poll alone {v['gather_alone_us']:.2f})" for k, v in sources.items()))
        if head_us:
            print(f"  output layer: handover {head_us['handover']:6.2f} us   work {head_us['work']:7.2f} us "
                  f"({head_us['table_TBps']:.2f} TB/s of table)")
        if seam_us:
            print("  between steps (median, us): " + ", ".join(f"{k} {v:.2f}" for k, v in seam_us.items()))
        print("  head's steps (median, us): " + ", ".join(f"{k[4:]} {v:.2f}" for k, v in att_steps.items()),
              flush=True)
        tag = (f"{name}_spare{spare}" + ("" if group == "auto" else f"_group{group}")
               + ("" if tiles == 1 else f"_tiles{tiles}") + ("" if sums else "_nosums") + ("" if packed else "_unpacked")
               + ("" if inflight == 1 else f"_inflight{inflight}") + ("" if loads is None else f"_loads{loads}")
               + ("" if norms else "_nonorms")
               + (f"_vocab{args.vocab}" if args.vocab else "")
               + ("_state" if kept else "") + (f"_steps{args.steps}" if args.steps > 1 else ""))
        plot(raw, L, os.path.join(args.out, f"trace_{tag}.png"),
             f"chain_mgpu {name}, layer {L // 2}, pos {args.pos}, spare={spare}, group={group}, "
             f"tiles={tiles}, loads={ran.sched.loads}")
        np.save(os.path.join(args.out, f"trace_{tag}.npy"), np.asarray(raw))
    with open(os.path.join(args.out, "trace_chain.json"), "w") as fh:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
