"""Which product splits make a whole megakernel decode step fastest for a model's shape?

The cost model (`pallas_kernels/chain/plan.py: choose_split`) prices each product alone, and
splits interact: at `1b` q|k|v 16x8 is 9% faster with o kept off the attention blocks and no
faster without (`benchmarks/decode.md`). This searches in whole steps instead: starting from
the cost model's splits, coordinate descent: o's blocks (`spare`) alone, the query heads an
attention block takes (grouped-query attention: `group`), the tile pieces a block makes at a
time (`tiles`, those given by --tiles), then product by product the cost
model's next-best splits (a distinct chunk-group count each), each under both o placements, keeping a change only when the step is at least --gain faster; rounds until
nothing changes. (A change that pays only beside another product's is still missed.) Each candidate is
timed as `decode_floor.py` times a `chain@OPTS` variant (greedy `generate`, batch 1,
random weights), so the winner is what the front door would run. It prints the
`plan.MEASURED` entry to add for the shape.

    python3 experiments/tune_chain_splits.py --preset llama3.2-1b --out $OUT     # one H200

Writes tune_chain_splits_<preset>.json (every candidate's time) to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_floor import run_case  # noqa: E402

from pallas_kernels.chain import attention as ca  # noqa: E402
from pallas_kernels.chain import plan  # noqa: E402
from pallas_kernels.chain import resolve as cr  # noqa: E402

NAMES = ("qkv", "o", "gu", "down")


def alternatives(D: int, N1: int, F: int, blocks: int, att_blocks: int, spare: bool,
                 k: int = 3) -> dict[str, list[tuple[int, int]]]:
    """Per product, the cost model's k best splits after its choice, each with a chunk-group
    count of its own, as (sk, st) in the model's order; o's within the blocks it may use
    (blocks - att_blocks when spare)."""
    ranked = {}
    chosen = plan.products(D, N1, F, blocks, True, att_blocks=att_blocks if spare else 0, ranked=ranked)
    out = {}
    for p in chosen:
        picks, groups = [], {p.split.sk}
        for _, split in ranked[p.name]:
            if split.sk not in groups and len(picks) < k:
                groups.add(split.sk)
                picks.append((split.sk, split.st))
        out[p.name] = picks
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration of the kernel: splits {name: (sk, st)} over the cost model's (as a
    sorted tuple), o's placement, the query heads an attention block takes (None: the
    kernel's choice, `attention.default_group` unless the shape is in `plan.MEASURED`) and
    the tile pieces a block makes at a time; options: more `chain@` options every candidate
    takes (e.g. "tiles=2")."""

    splits: tuple = ()
    spare: bool = False
    group: int | None = None
    tiles: int = 1
    options: str = ""

    def split(self, name: str, sk_st: tuple[int, int]) -> Candidate:
        return dataclasses.replace(self, splits=tuple(sorted({**dict(self.splits), name: sk_st}.items())))

    def variant(self, stages: int = 16) -> str:
        """Its `chain@OPTS` variant (`decode_floor.chain_options`)."""
        opts = [str(stages), f"spare={int(self.spare)}"] + ([f"group={self.group}"] if self.group else [])
        opts += [f"tiles={self.tiles}"] if self.tiles != 1 else []
        opts += [self.options] if self.options else []
        return "chain@" + ",".join(opts + [f"{n}={sk}x{st}" for n, (sk, st) in self.splits])


def descend(time_ms, alts_for, groups=(None,), gain: float = 0.005, rounds: int = 3, tiles=(1,),
            options: str = ""):
    """Coordinate descent from the cost model's splits: (the best `Candidate`, its ms, every
    timing {variant: ms}). time_ms(candidate) -> ms (inf for one that fails);
    alts_for(spare, group) -> {name: [(sk, st), ...]} (`alternatives`); groups: the attention
    groups to try; tiles: the tile counts to try; options: every candidate's further
    `chain@` options (`Candidate.options`). Each round tries o's other placement, the
    other groups and tile counts, then each
    product's alternatives under both placements; a change is kept when it is at least
    `gain` (relative) faster than the best so far."""
    seen = {}

    def timed(c):
        if c.variant() not in seen:
            seen[c.variant()] = time_ms(c)
        return seen[c.variant()]

    best = Candidate(options=options)
    best_ms = timed(best)
    for _ in range(rounds):
        changed = False
        trials = [dataclasses.replace(best, spare=not best.spare)]
        trials += [dataclasses.replace(best, group=g) for g in groups if g != best.group]
        trials += [dataclasses.replace(best, tiles=t) for t in tiles if t != best.tiles]
        for trial in trials:
            if (ms := timed(trial)) < best_ms * (1 - gain):
                best, best_ms, changed = trial, ms, True
        for name in NAMES:  # each alternative under both o placements: they interact
            for spare in (best.spare, not best.spare):
                for split in alts_for(spare, best.group)[name]:
                    trial = dataclasses.replace(best, spare=spare).split(name, split)
                    if (ms := timed(trial)) < best_ms * (1 - gain):
                        best, best_ms, changed = trial, ms, True
        if not changed:
            break
    return best, best_ms, seen


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--alternatives", type=int, default=3, help="next-best splits tried a product")
    ap.add_argument("--gain", type=float, default=0.005, help="least relative gain that counts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiles", type=int, nargs="+", default=[1],
                    help="tile pieces a block makes at a time, each tried (chain_mgpu's tiles)")
    ap.add_argument("--options", default="",
                    help="chain@ options every candidate takes, e.g. tiles=2 (decode_floor's)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import jax  # noqa: PLC0415

    from gendist.inference import decoder  # noqa: PLC0415
    from gendist.models import transformer  # noqa: PLC0415
    from gendist.presets import preset  # noqa: PLC0415
    from gendist.timing import warm_gpu  # noqa: PLC0415
    from pallas_kernels._mgpu import sm_count  # noqa: PLC0415

    cfg = preset(args.preset).model
    D, F, hd, K = cfg.d_model, cfg.d_ff, cfg.head_dim, cfg.num_kv_heads
    N1, NQ = D + 2 * K * hd, D // hd
    blocks = sm_count()
    default = cr.attention_group(D, N1, F, blocks, hd, K)  # the kernel's choice
    groups = (None,) + tuple(g for g in range(1, ca.group_of(NQ, K) + 1)  # None: the default
                             if (NQ // K) % g == 0 and g != default)
    warm_gpu()
    params = decoder.layout(cfg, transformer.init_params(cfg, 0), "megakernel")

    def time_ms(c: Candidate) -> float:
        try:
            ms = run_case(cfg, params, 1, c.variant(), args, profile=False)["ms_per_step"]
        except Exception as e:  # noqa: BLE001 - a split the kernel cannot take: say so, go on
            print(f"{c.variant()}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("inf")
        print(f"{c.variant()}: {ms:.4f} ms a step", flush=True)
        return ms

    def alts_for(spare, group):
        return alternatives(D, N1, F, blocks, NQ // (group or default), spare, args.alternatives)

    best, ms, seen = descend(time_ms, alts_for, groups, args.gain, args.rounds, tuple(args.tiles), args.options)
    start = seen[Candidate(options=args.options).variant()]
    entry = (tuple((n, *split) for n, split in best.splits), best.spare, best.group)
    print(f"best: {best.variant()} {ms:.4f} ms a step, the cost model's {start:.4f} "
          f"({1 - ms / start:.1%} faster)")
    print(f"plan.MEASURED entry: {(D, N1, F, blocks, hd)}: {entry},  "
          f"# {args.preset}: {ms:.3f} ms, not {start:.3f}" + (f"; tiles={best.tiles}" if best.tiles != 1 else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tune_chain_splits_{args.preset}.json").write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, preset=args.preset,
        key=[D, N1, F, blocks, hd], cost_model_ms=start, best=best.variant(), best_ms=ms,
        entry=[[list(e) for e in entry[0]], entry[1], entry[2]], tiles=best.tiles, timed=seen), indent=1))


if __name__ == "__main__":
    main()
