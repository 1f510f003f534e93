"""Static pipeline schedules by name: GPipe, 1F1B, 1F1B-split, ZB-H1, interleaved 1F1B, ...

A schedule is data, not control flow: the executor (`pipeline.py`) runs any valid table
inside one SPMD program, so a new schedule is a new table, not a new executor. Time is
counted in units of one stage-action (forward and backward cost one unit each) and a
message crosses one stage boundary per step, the model of GPipe (Huang et al. 2019) and of
the 1F1B schedule of PipeDream-Flush (Narayanan et al. 2019) as used by Megatron-LM
(Narayanan et al. 2021). Tables are built by running each stage's action order as soon as
its dependencies allow (ASAP), so the timing follows from the order alone. Counting and
drawing tables (bubble, lock-step time, memory held, pictures): `schedule_stats`.

Interleaved schedules (Narayanan et al. 2021, section 2.2.1) run p x v *virtual* stages on
p devices: device d holds the v chunks of layers of virtual stages d, d + p, d + 2p, ...
The table stays [steps, virtual stages] (so dependencies, memory and buffers are counted
as for any schedule), a step is one chunk-action (1/v of a stage-action), and `validate`
adds that a device runs at most one action per step. The executor's per-device view of a
table (buffer slots, chunks): `schedule_plan`. The table type, its validation and timing
live in `schedule_table` and are re-exported here, where every caller finds them.
"""

from __future__ import annotations

import numpy as np

from gendist.parallel.pipeline.table import (  # re-exported: the schedule API in one place
    BACKWARD,
    FORWARD,
    IDLE,
    WEIGHT,
    Schedule,
    action_times,
    all_action_times,
    check_sizes,
    from_device_orders,
    from_stage_orders,
    validate,
)

__all__ = ["BACKWARD", "FORWARD", "IDLE", "WEIGHT", "Schedule", "action_times",
           "all_action_times", "check_sizes", "from_device_orders", "from_stage_orders",
           "validate", "gpipe", "one_f_one_b", "sequential", "list_schedule",
           "one_f_one_b_split", "zb_h1", "one_f_one_b_phased", "interleaved_1f1b",
           "SCHEDULES", "INTERLEAVED", "make"]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards; stage holds m inputs."""
    check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    order = [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    return from_stage_orders([list(order) for _ in range(num_stages)], m, "gpipe")


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with a flush (PipeDream-Flush; Megatron-LM's default non-interleaved schedule).

    Stage s runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. At most p - s microbatches are ever
    in flight on stage s, so activation memory does not grow with m; the bubble equals
    GPipe's (p-1)/(m+p-1).
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [(FORWARD, i) for i in range(warm)]
        for i in range(m - warm):
            order += [(FORWARD, warm + i), (BACKWARD, i)]
        order += [(BACKWARD, i) for i in range(m - warm, m)]
        orders.append(order)
    return from_stage_orders(orders, m, "1f1b")


def sequential(num_stages: int, num_microbatches: int) -> Schedule:
    """One microbatch in flight: microbatch i+1 enters only after i's backward left stage 0.

    No overlap (bubble 1 - 1/p, the worst case), but no staleness either: with per-microbatch
    updates (PipeDream) every forward sees the weights of all earlier microbatches.
    """
    check_sizes(num_stages, num_microbatches)
    order = [a for i in range(num_microbatches) for a in ((FORWARD, i), (BACKWARD, i))]
    return from_stage_orders([list(order) for _ in range(num_stages)], num_microbatches,
                             "sequential")


class _ListState:
    """Progress of a list scheduler: per stage, how many F, B and W it ran, and when."""

    def __init__(self, num_stages: int, num_microbatches: int):
        self.p, self.m = num_stages, num_microbatches
        self.done: dict[tuple[int, int, int], int] = {}
        self.nf, self.nb, self.nw = [0] * num_stages, [0] * num_stages, [0] * num_stages
        self.rows_kind: list[list[int]] = []
        self.rows_mb: list[list[int]] = []

    def ready(self, s: int, t: int, limit, until: str) -> dict[str, int]:
        """{'F'|'B'|'W': microbatch} that stage s may run at step t: B(i) once stage s+1 ran
        B(i) (the last stage: once it ran F(i)), F(i) once stage s-1 ran F(i) and fewer than
        `limit(s)` microbatches are in flight (forwarded and, with `until` = 'W', weight step
        not yet run; 'B': backward not yet run), W for the oldest microbatch whose B ran."""
        ready = {}
        i = self.nb[s]
        dep = (s + 1, BACKWARD, i) if s < self.p - 1 else (s, FORWARD, i)
        if i < self.nf[s] and self.done.get(dep, t) < t:
            ready["B"] = i
        j = self.nf[s]
        held = self.nf[s] - (self.nw[s] if until == "W" else self.nb[s])
        if (j < self.m and (s == 0 or self.done.get((s - 1, FORWARD, j), t) < t)
                and held < limit(s)):
            ready["F"] = j
        if self.nw[s] < self.nb[s]:
            ready["W"] = self.nw[s]
        return ready

    def commit(self, row_k: list[int], row_m: list[int], t: int, name: str) -> None:
        if all(k == IDLE for k in row_k):
            raise ValueError(f"schedule {name!r} deadlocks at step {t}")
        for s, (k, i) in enumerate(zip(row_k, row_m, strict=True)):
            if k != IDLE:
                self.done[(s, k, i)] = t
                self.nf[s] += k == FORWARD
                self.nb[s] += k == BACKWARD
                self.nw[s] += k == WEIGHT
        self.rows_kind.append(row_k)
        self.rows_mb.append(row_m)

    def schedule(self, name: str) -> Schedule:
        sched = Schedule(name, np.asarray(self.rows_kind, np.int32).reshape(-1, self.p),
                         np.asarray(self.rows_mb, np.int32).reshape(-1, self.p), int(self.m))
        validate(sched)
        return sched


_KINDS = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}


def list_schedule(num_stages: int, num_microbatches: int, *, priority: str, limit,
                  name: str, until: str = "W") -> Schedule:
    """A split schedule (B and W separate) by list scheduling, one action per stage-step.

    At every step each stage runs the first action of `priority` (a string of 'F', 'B',
    'W') that is ready (`_ListState.ready`: dependencies met, fewer than `limit(s)`
    microbatches in flight). B and F go in microbatch order.
    """
    check_sizes(num_stages, num_microbatches)
    state = _ListState(num_stages, num_microbatches)
    t = 0
    while min(state.nw) < num_microbatches:
        row_k, row_m = [IDLE] * num_stages, [-1] * num_stages
        for s in range(num_stages):
            ready = state.ready(s, t, limit, until)
            for c in priority:
                if c in ready:
                    row_k[s], row_m[s] = _KINDS[c], ready[c]
                    break
        state.commit(row_k, row_m, t, name)
        t += 1
    return state.schedule(name)


def one_f_one_b_split(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with each backward split into B and W run back to back (W first when both are
    ready): 1F1B's order and memory (p - s in flight), every action about one unit of work,
    so stages in lock step do not wait on each other's longer backwards."""
    return list_schedule(num_stages, num_microbatches, priority="WBF",
                         limit=lambda s: num_stages - s, name="1f1b-split")


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the weight steps W
    deferred into the bubbles - a stage prefers B, then F, and runs W when neither is ready
    - at 1F1B's peak memory (at most p microbatches held by any stage, as 1F1B's first
    stage). With equal F, B and W the bubble approaches (p-1) step units against
    1F1B's 3(p-1): 3m + p - 1 steps. This greedy construction reaches it at p = 2 and is a
    step or two longer at p = 4 (tested)."""
    return list_schedule(num_stages, num_microbatches, priority="BFW",
                         limit=lambda s: num_stages, name="zb-h1")


def one_f_one_b_phased(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B in phases: at every step all stages run the same kind of action, forwards and
    backwards alternating (a phase with nothing ready gives way to the other kind).

    Made for a lock-step executor, where a step lasts as long as its slowest action: in
    1F1B's steady state one stage's forward shares a step with its neighbour's backward
    (about two forwards long), so every step costs a backward. Here F-steps cost a forward
    and B-steps a backward, so the table's lock-step time (`schedule_stats.lockstep_time`)
    equals GPipe's, while stage s holds at most 2(p - s) - 1 microbatches (GPipe: m; 1F1B:
    p - s).
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    state = _ListState(p, m)
    limit = lambda s: 2 * (p - s) - 1
    t, phase = 0, "B"
    while min(state.nb) < m:
        ready = [state.ready(s, t, limit, until="B") for s in range(p)]
        phase = "F" if phase == "B" else "B"
        if not any(phase in r for r in ready):
            phase = "F" if phase == "B" else "B"
        row_k = [_KINDS[phase] if phase in r else IDLE for r in ready]
        row_m = [r.get(phase, -1) for r in ready]
        state.commit(row_k, row_m, t, "1f1b-phased")
        t += 1
    return state.schedule("1f1b-phased")


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int = 2
                     ) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.1; Megatron-LM's
    `forward_backward_pipelining_with_interleaving`): each of the p = `num_stages` devices
    holds v = `num_chunks` chunks of layers, device d the virtual stages d, d + p, ...

    Device d runs its forwards in groups of p microbatches per chunk (microbatches 0..p-1
    through chunk 0, then through chunk 1, ..., then the next p microbatches), first
    2(p - d - 1) + (v - 1)p warm-up forwards, then one forward and one backward in turn
    (backwards in the same groups, last chunk first), then the remaining backwards. A step
    is one chunk-action, 1/v of a stage-action: the bubble, p - 1 stage-actions of each kind
    for 1F1B, shrinks to (p - 1)/v (tested). Needs m to be a multiple of p (Megatron's rule).
    """
    check_sizes(num_stages, num_microbatches)
    p, m, v = num_stages, num_microbatches, num_chunks
    if not isinstance(v, int | np.integer) or v < 1:
        raise ValueError(f"num_chunks={v!r} must be an int >= 1 (chunks of layers per device)")
    if m % p:
        raise ValueError(f"num_microbatches={m}: interleaved 1F1B runs microbatches in groups "
                         f"of p={p} (Megatron's rule); use a multiple of {p}")
    total = m * v

    def action(j, forward):  # the device's j-th forward (or backward): (chunk, microbatch)
        c = (j % (p * v)) // p
        return (c if forward else v - 1 - c), (j // (p * v)) * p + j % p

    orders = []
    for d in range(p):
        warm = min(2 * (p - d - 1) + (v - 1) * p, total)
        fwd = [(FORWARD, *action(j, True)) for j in range(total)]
        bwd = [(BACKWARD, *action(j, False)) for j in range(total)]
        order = fwd[:warm]
        for j in range(total - warm):
            order += [fwd[warm + j], bwd[j]]
        order += bwd[total - warm:]
        orders.append([(k, c * p + d, i) for k, c, i in order])
    return from_device_orders(orders, p * v, m, "interleaved-1f1b")


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "sequential": sequential,
             "1f1b-split": one_f_one_b_split, "zb-h1": zb_h1, "1f1b-phased": one_f_one_b_phased}


INTERLEAVED = {"interleaved-1f1b": interleaved_1f1b}


def make(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Builds a named schedule: 'gpipe', '1f1b', '1f1b-phased', '1f1b-split', 'zb-h1',
    'sequential', or 'interleaved-1f1b' over `num_stages` devices with `num_chunks` >= 2
    chunks of layers each (`train.pipeline_chunks`)."""
    if name in INTERLEAVED:
        if num_chunks < 2:
            raise ValueError(f"train.pipeline_chunks={num_chunks}: schedule {name!r} needs at "
                             "least 2 chunks of layers per device; set --train.pipeline-chunks 2")
        return INTERLEAVED[name](num_stages, num_microbatches, num_chunks)
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is unknown; use one of "
                         f"{sorted(SCHEDULES) + sorted(INTERLEAVED)}")
    if num_chunks != 1:
        raise ValueError(f"train.pipeline_chunks={num_chunks}: schedule {name!r} runs one chunk "
                         "of layers per device; use 'interleaved-1f1b' or pipeline_chunks=1")
    return SCHEDULES[name](num_stages, num_microbatches)
