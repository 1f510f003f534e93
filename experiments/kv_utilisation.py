"""KV-cache memory utilisation of contiguous reservation vs paging, on a seeded request workload.

Kwon et al. 2023 (vLLM, Fig. 2) measured that earlier serving systems kept only 20-38% of KV
memory holding token states, the rest lost to reservation (slots held for tokens not yet
generated), internal fragmentation (slots reserved past a request's final length) and external
fragmentation (free memory split into holes too small for the next request); paging wastes
under 4%. This script replays one workload through a continuous-batching scheduler on an equal
memory budget under four policies and splits the budget, averaged over decode steps, into
those categories (over the steps where requests wait for memory), plus the batch size each
policy sustains and the steps it needs to serve the whole workload:

* contiguous_max: reserve the model's max length per request (FasterTransformer, Orca-Max);
* contiguous_pow2: reserve the final length rounded up to a power of two, first-fit arena;
* contiguous_oracle: reserve exactly the final length (an oracle), first-fit arena;
* paged: pages of `page_size` tokens taken on demand from `gendist.inference.page_allocator`
  (jitted operations on CPU); admits while 1% of pages stay free, and preempts the newest
  request (recompute: it rejoins the queue with its tokens so far) when the pool runs dry.

    python experiments/kv_utilisation.py --out benchmarks

writes benchmarks/kv_utilisation.json and .png. Pure simulation: no model runs.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import deque

import jax.numpy as jnp
import numpy as np

from gendist.inference import page_allocator as pa

CATEGORIES = ("useful", "reserved", "internal", "external", "free")


def make_workload(n: int, max_len: int, seed: int):
    """(prompt, output) token counts, log-normal like chat traces, clipped to max_len."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(160), 0.9, n), 4, max_len // 2).astype(int)
    output = np.clip(rng.lognormal(np.log(180), 0.9, n), 1, max_len - prompt).astype(int)
    return list(zip(prompt.tolist(), output.tolist(), strict=True))


class Arena:
    """A contiguous KV buffer of `budget` token slots with first-fit placement."""

    def __init__(self, budget: int, reserve):
        self.budget, self.reserve, self.extents = budget, reserve, {}

    def _fit(self, size):
        start = 0
        for s, n in sorted(self.extents.values()):
            if s - start >= size:
                return start
            start = s + n
        return start if self.budget - start >= size else None

    def need(self, req):
        return self.reserve(*req)

    def admit(self, rid, req):
        start = self._fit(self.need(req))
        if start is None:
            return False
        self.extents[rid] = (start, self.need(req))
        return True

    def step(self, running):
        return []  # memory was reserved up front: decoding never needs more

    def release(self, rid):
        del self.extents[rid]

    def split(self, running):
        """Budget split (token slots): useful, reserved (future tokens), internal, used total."""
        useful = sum(r["len"] for r in running.values())
        final = sum(r["final"] for r in running.values())
        held = sum(n for _, n in self.extents.values())
        return useful, final - useful, held - final, held


class Paged:
    """Pages on demand through the jitted page allocator."""

    def __init__(self, budget: int, page_size: int, max_seqs: int, max_len: int):
        self.z = page_size
        self.state = pa.init_allocator(budget // page_size, page_size, max_seqs, -(-max_len // page_size))
        self.slot = {}
        self.watermark = max(1, self.state.num_pages // 100)  # vLLM keeps 1% free for growth

    def need(self, req):
        return (-(-req[0] // self.z) + self.watermark) * self.z  # what admission asks to be free

    def admit(self, rid, req):
        if self.need(req) > int(self.state.num_free) * self.z or bool(self.state.active.all()):
            return False
        self.state, slot, st = pa.allocate_slot(self.state)
        self.state, st2 = pa.grow(self.state, slot, req[0])
        assert int(st) == int(st2) == pa.OK
        self.slot[rid] = int(slot)
        return True

    def step(self, running):
        """Every running sequence grows by one token; preempts the newest while pages are short."""
        preempted = []
        while True:
            n_S = np.zeros(self.state.max_seqs, np.int32)
            n_S[[self.slot[r] for r in running]] = 1
            new, status = pa.grow_batch(self.state, jnp.asarray(n_S))
            if int(status) == pa.OK:
                self.state = new
                return preempted
            assert int(status) == pa.NO_PAGES
            victim = max(running, key=lambda r: running[r]["admitted"])
            preempted.append(victim)
            self.release(victim)
            running = {r: v for r, v in running.items() if r != victim}

    def release(self, rid):
        self.state, st = pa.free(self.state, self.slot.pop(rid))
        assert int(st) == pa.OK

    def split(self, running):
        useful = sum(r["len"] for r in running.values())
        held = int(np.sum(np.asarray(self.state.refcounts) > 0)) * self.z
        return useful, 0, held - useful, held


def simulate(policy, workload, budget: int):
    """Continuous batching: FCFS admission, one token per running request per step."""
    queue = deque((i, p, o) for i, (p, o) in enumerate(workload))
    running, sums, steps, batch, preemptions = {}, dict.fromkeys(CATEGORIES, 0.0), 0, [], 0
    while queue or running:
        while queue and policy.admit(queue[0][0], queue[0][1:]):
            rid, p, o = queue.popleft()
            running[rid] = dict(len=p, final=p + o, admitted=steps, req=(p, o))
        if not running:
            raise ValueError(f"budget={budget} tokens cannot hold request {queue[0]}; raise --budget")
        if queue:  # saturated: requests wait for memory, so the split measures the policy
            useful, reserved, internal, held = policy.split(running)
            free = budget - held
            # Free memory is external fragmentation when it would hold the waiting request but
            # no single hole does; otherwise it is simply free.
            external = free if free >= policy.need(queue[0][1:]) else 0
            split = (useful, reserved, internal, external, free - external)
            for k, v in zip(CATEGORIES, split, strict=True):
                sums[k] += v / budget
            batch.append(len(running))
        for rid in policy.step(running):  # recompute-style preemption: back to the queue front
            r = running.pop(rid)
            queue.appendleft((rid, r["len"], r["final"] - r["len"]))
            preemptions += 1
        steps += 1
        for rid in list(running):
            running[rid]["len"] += 1
            if running[rid]["len"] == running[rid]["final"]:
                policy.release(rid)
                del running[rid]
    if not batch:
        raise ValueError(f"no request ever waited for memory (budget={budget} tokens); "
                         "raise --requests or lower --budget so that the policies are compared under load")
    frac = {k: v / len(batch) for k, v in sums.items()}
    held = frac["useful"] + frac["reserved"] + frac["internal"]
    return dict(budget_fraction=frac, utilisation=frac["useful"] / held, waste=1 - frac["useful"] / held,
                mean_batch=float(np.mean(batch)), max_batch=int(np.max(batch)), steps=steps,
                saturated_steps=len(batch),
                preemptions=preemptions)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    colors = dict(useful="tab:green", reserved="tab:orange", internal="tab:red", external="tab:purple",
                  free="lightgrey")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = np.zeros(len(names))
    for c in CATEGORIES:
        vals = np.array([results[n]["budget_fraction"][c] for n in names]) * 100
        ax.bar(names, vals, bottom=bottom, label=c, color=colors[c])
        bottom += vals
    ax.set_ylabel("% of KV memory budget (mean over steps)")
    ax.set_title("KV memory by use")
    ax.set_ylim(0, 118)
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    ax.tick_params(axis="x", rotation=20)
    bx.bar(names, [results[n]["mean_batch"] for n in names], color="tab:blue")
    bx.set_ylabel("mean running sequences")
    bx.set_title("sequences served at an equal budget")
    bx.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for kv_utilisation.json/.png")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=32 * 2048, help="KV budget in token slots")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = make_workload(args.requests, args.max_len, args.seed)
    pow2 = lambda p, o: 1 << (p + o - 1).bit_length()
    policies = dict(
        contiguous_max=Arena(args.budget, lambda p, o: args.max_len),
        contiguous_pow2=Arena(args.budget, lambda p, o: min(pow2(p, o), args.max_len)),
        contiguous_oracle=Arena(args.budget, lambda p, o: p + o),
        paged=Paged(args.budget, args.page_size, max_seqs=args.budget // args.page_size,
                    max_len=args.max_len),
    )
    results = {name: simulate(pol, work, args.budget) for name, pol in policies.items()}
    lengths = np.array([p + o for p, o in work])
    res = dict(config=vars(args), mean_final_length=float(lengths.mean()), results=results,
               # a static count: sequences of this length mix that fit the budget at once
               static_fit=dict(contiguous_max=args.budget // args.max_len,
                               paged=int(args.budget / np.mean(-(-lengths // args.page_size) * args.page_size))))
    print(f"{'policy':18s} {'useful':>7s} {'reserv':>7s} {'intern':>7s} {'extern':>7s} {'free':>7s} "
          f"{'util':>6s} {'batch':>6s} {'steps':>6s} {'preempt':>7s}")
    for name, r in results.items():
        f = r["budget_fraction"]
        print(f"{name:18s} " + " ".join(f"{100 * f[c]:6.1f}%" for c in CATEGORIES)
              + f" {100 * r['utilisation']:5.1f}% {r['mean_batch']:6.1f} {r['steps']:6d} {r['preemptions']:7d}")
    print("static fit at this budget:", res["static_fit"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_utilisation.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        plot(results, os.path.join(args.out, "kv_utilisation.png"))
    return res


if __name__ == "__main__":
    main()
