"""Counting and drawing schedule tables: the bubble (from the table and analytic), the time
of a table on a lock-step executor or with real action costs, the microbatches each stage
holds, a text and a matplotlib picture, and the plan lines of `python -m gendist plan`.
The tables themselves are built in `gendist.parallel.pipeline.schedules`."""

from __future__ import annotations

import numpy as np

from gendist.parallel.pipeline.plan import buffer_plan
from gendist.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    IDLE,
    WEIGHT,
    Schedule,
    all_action_times,
    check_sizes,
    make,
)

_LETTER = {IDLE: ".", FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


def bubble_fraction(schedule: Schedule) -> float:
    """Fraction of (step, device) slots that are idle, counted from the table (a device
    with v chunks is busy when any of its virtual stages acts)."""
    slots = schedule.num_steps * schedule.num_devices
    return (slots - int(np.sum(schedule.kind != IDLE))) / slots  # idle / all, exactly


def stage_time(schedule: Schedule) -> float:
    """The table's length in stage-actions: a step of an interleaved table is one chunk,
    1/v of a stage's layers, so it costs 1/v of a step of a one-chunk table (the timing
    model of Narayanan et al. 2021, section 2.2.1)."""
    return schedule.num_steps / schedule.num_chunks


def analytic_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """(p-1)/(m+p-1): the bubble of GPipe and of 1F1B with equal forward/backward cost."""
    check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def weighted_timeline(schedule: Schedule, fwd_cost, bwd_cost, wgt_cost=0.0
                      ) -> tuple[float, float]:
    """(makespan, idle fraction) when actions take real times instead of one step each.

    fwd_cost / bwd_cost / wgt_cost: [microbatches] or [stages, microbatches] (a split
    schedule's B costs bwd_cost, its W wgt_cost). Each stage runs its actions in table
    order, each as soon as its stage is free and its input has arrived (communication
    free), so unequal slices or microbatches show their own bubbles.
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    cost = {k: np.broadcast_to(np.asarray(c, np.float64), (p, m))
            for k, c in ((FORWARD, fwd_cost), (BACKWARD, bwd_cost), (WEIGHT, wgt_cost))}
    end: dict[tuple[int, int, int], float] = {}
    devices = schedule.num_devices
    free = np.zeros(devices)  # a device runs its virtual stages one at a time
    for t, s in zip(*np.nonzero(schedule.kind != IDLE), strict=True):
        k, i = int(schedule.kind[t, s]), int(schedule.microbatch[t, s])
        if k == FORWARD:
            ready = end.get((s - 1, FORWARD, i), 0.0)
        elif k == BACKWARD:
            ready = end[(s + 1, BACKWARD, i)] if s < p - 1 else end[(s, FORWARD, i)]
        else:
            ready = end[(s, BACKWARD, i)]
        start = max(free[s % devices], ready)
        free[s % devices] = end[(s, k, i)] = start + cost[k][s, i]
    makespan = float(free.max())
    busy = sum(float(cost[k].sum()) for k in (FORWARD, BACKWARD)) + (
        float(cost[WEIGHT].sum()) if schedule.split else 0.0)
    return makespan, 1.0 - busy / (devices * makespan)


def in_flight_per_stage(schedule: Schedule) -> np.ndarray:
    """[stages] the most microbatches forwarded but not yet done (backward, or weight step
    when split) at any step: what a stage holds."""
    fwd, _, bwd = all_action_times(schedule)
    steps = np.arange(schedule.num_steps)[:, None, None]
    live = (fwd[None] <= steps) & (steps < bwd[None])  # [steps, stages, microbatches]
    return live.sum(-1).max(0)


def in_flight_per_device(schedule: Schedule) -> np.ndarray:
    """[devices] the most (chunk, microbatch) inputs a device holds at once, over all its
    virtual stages (each 1/v of a stage's activations); = in_flight_per_stage for v = 1."""
    fwd, _, bwd = all_action_times(schedule)
    steps = np.arange(schedule.num_steps)[:, None, None]
    live = ((fwd[None] <= steps) & (steps < bwd[None])).sum(-1)  # [steps, stages]
    return live.reshape(len(live), -1, schedule.num_devices).sum(1).max(0)


def max_in_flight(schedule: Schedule) -> int:
    """The most microbatches any stage holds: p for 1F1B, m for GPipe."""
    return int(in_flight_per_stage(schedule).max())


def _cells(schedule: Schedule):
    """(step, device, kind, microbatch, chunk) of every action."""
    d = schedule.num_devices
    for t, s in zip(*np.nonzero(schedule.kind != IDLE), strict=True):
        yield int(t), int(s) % d, int(schedule.kind[t, s]), int(schedule.microbatch[t, s]), \
            int(s) // d


def to_text(schedule: Schedule) -> str:
    """One row per device, one column per step: F3 = forward of microbatch 3, '.' = idle;
    on an interleaved table a letter names the chunk (F3b: microbatch 3 through chunk 1)."""
    v = schedule.num_chunks
    width = len(str(schedule.num_microbatches - 1)) + 1 + (v > 1)
    grid = [["."] * schedule.num_steps for _ in range(schedule.num_devices)]
    for t, d, k, i, c in _cells(schedule):
        grid[d][t] = _LETTER[k] + str(i) + ("abcdefgh"[c] if v > 1 else "")
    what = (f"{schedule.num_devices} devices x {v} chunks" if v > 1
            else f"{schedule.num_stages} stages")
    lines = [f"{schedule.name}: {what}, {schedule.num_microbatches} microbatches, "
             f"{schedule.num_steps} steps, bubble {bubble_fraction(schedule):.3f}"]
    lines += [f"stage {d}: " + " ".join(c.ljust(width) for c in row)
              for d, row in enumerate(grid)]
    return "\n".join(lines)


def plot(schedule: Schedule, ax=None):
    """Draws the table as a time x device chart (forwards blue, backwards orange, weight
    steps green; an interleaved table's later chunks lighter)."""
    import matplotlib.pyplot as plt

    n, p, v = schedule.num_steps, schedule.num_devices, schedule.num_chunks
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.32 * n), 0.5 * p + 1))
    colors = {FORWARD: "#4c72b0", BACKWARD: "#dd8452", WEIGHT: "#55a868"}
    for t, d, k, i, c in _cells(schedule):
        ax.add_patch(plt.Rectangle((t, d), 1, 1, facecolor=colors[k], edgecolor="white",
                                   alpha=1.0 - 0.45 * c / max(v - 1, 1)))
        if n <= 80:
            ax.text(t + 0.5, d + 0.5, str(i), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_xlim(0, n)
    ax.set_ylim(p, 0)
    ax.set_xlabel("time step" + (f" (one chunk = 1/{v} stage)" if v > 1 else ""))
    ax.set_ylabel("stage")
    ax.set_yticks(np.arange(p) + 0.5, [str(s) for s in range(p)])
    chunks = f" x v={v}" if v > 1 else ""
    ax.set_title(f"{schedule.name}: p={p}{chunks}, m={schedule.num_microbatches}, "
                 f"bubble {bubble_fraction(schedule):.2f} (blue F, orange B"
                 + (", green W)" if schedule.split else ")"))
    return ax


def lockstep_time(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0,
                  wgt_cost: float = 1.0) -> float:
    """Time of the table on a lock-step executor (each step lasts its slowest action; a
    backward costs about two forwards, a split one's B and W about one each)."""
    cost = np.array([0.0, fwd_cost, bwd_cost, wgt_cost])
    if schedule.split:
        cost[BACKWARD] = bwd_cost - wgt_cost
    return float(cost[schedule.kind].max(axis=1).sum())

def pipeline_plan_lines(num_stages: int, num_microbatches: int, schedule: str | Schedule,
                        num_chunks: int = 1) -> list[str]:
    """Human-readable bubble and memory accounting of one schedule, for `python -m gendist plan`.

    Counts idle slots in the table and compares with the analytic (p-1)/(m+p-1), and lists
    the microbatches each stage holds at once (the activation memory GPipe grows with m and
    1F1B caps at p - s).
    """
    sched = (make(schedule, num_stages, num_microbatches, num_chunks)
             if isinstance(schedule, str) else schedule)
    if (sched.num_devices, sched.num_microbatches) != (num_stages, num_microbatches):
        raise ValueError(f"schedule {sched.name!r} has p={sched.num_devices}, m="
                         f"{sched.num_microbatches}; pass num_stages={sched.num_devices}, "
                         f"num_microbatches={sched.num_microbatches}")
    p, m, v = num_stages, num_microbatches, sched.num_chunks
    if v > 1:
        idle = sched.num_steps * p - int(np.sum(sched.kind != IDLE))
        flight = in_flight_per_device(sched)
        return [
            f"pipeline schedule {sched.name}: p={p} devices x v={v} chunks, m={m} "
            f"microbatches, {sched.num_steps} steps of one chunk-action "
            f"({stage_time(sched):g} stage-actions)",
            f"  bubble (table): {idle}/{sched.num_steps * p} idle device-steps = "
            f"{bubble_fraction(sched):.4f}",
            f"  bubble (analytic (p-1)/(vm+p-1)): {(p - 1) / (v * m + p - 1):.4f}",
            "  chunk-microbatches in flight per device: "
            + " ".join(str(int(f)) for f in flight)
            + f" (each 1/{v} of a stage's; buffer slots {buffer_plan(sched).num_slots})",
        ]
    idle = int(np.sum(sched.kind == IDLE))
    flight = in_flight_per_stage(sched)
    return [
        f"pipeline schedule {sched.name}: p={p} stages, m={m} microbatches, "
        f"{sched.num_steps} steps of one forward or backward",
        f"  bubble (table): {idle}/{sched.num_steps * p} idle stage-steps = "
        f"{bubble_fraction(sched):.4f}",
        f"  bubble (analytic (p-1)/(m+p-1)): {analytic_bubble_fraction(p, m):.4f}",
        "  microbatches in flight per stage: " + " ".join(str(int(f)) for f in flight)
        + f" (max {int(flight.max())}; buffer slots {buffer_plan(sched).num_slots})",
    ]
