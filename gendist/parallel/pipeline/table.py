"""A pipeline schedule as data: the table [steps, stages] of (action, microbatch), its
validation and its dependency times.

A schedule is data, not control flow: the executor (`pipeline/core.py`) runs any valid table
inside one SPMD program, so a new schedule is a new table, not a new executor. Time is
counted in units of one stage-action (forward and backward cost one unit each) and a
message crosses one stage boundary per step (GPipe, Huang et al. 2019; 1F1B, Narayanan et
al. 2019/2021). A table is built from each stage's (or device's) action order, run as soon
as its dependencies allow (ASAP): `from_stage_orders`, `from_device_orders`. Interleaved
tables run p x v virtual stages on p devices; `validate` then also checks that a device runs
at most one action per step. The named schedules are in `schedule`; counting and drawing
tables in `schedule_stats`; the executor's per-device plan in `schedule_plan`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A static pipeline schedule.

    `kind[t, s]` is IDLE, FORWARD or BACKWARD for stage s at step t; `microbatch[t, s]` is
    the microbatch it acts on (-1 when idle). Both are numpy int32 arrays [steps, stages].
    `num_devices` < num_stages makes the stages virtual: stage s runs on device
    s % num_devices, as its chunk s // num_devices (None: one stage per device).
    """

    name: str
    kind: np.ndarray
    microbatch: np.ndarray
    num_microbatches: int
    num_devices: int | None = None

    def __post_init__(self):
        if self.num_devices is None:
            object.__setattr__(self, "num_devices", self.num_stages)

    @property
    def num_steps(self) -> int:
        return int(self.kind.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.kind.shape[1])

    @property
    def num_chunks(self) -> int:
        """Virtual stages (chunks of layers) per device: v of the interleaved schedule."""
        return self.num_stages // self.num_devices

    @property
    def split(self) -> bool:
        """Whether backwards are split into B (input gradient) and W (weight gradient)."""
        return bool(np.any(self.kind == WEIGHT))


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int | np.integer) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1 (the pipeline mesh size)")
    if not isinstance(num_microbatches, int | np.integer) or num_microbatches < 1:
        raise ValueError(
            f"num_microbatches={num_microbatches!r} must be an int >= 1; "
            "use at least num_stages microbatches to keep the bubble small"
        )


def from_stage_orders(
    orders: list[list[tuple[int, int]]], num_microbatches: int, name: str
) -> Schedule:
    """Times each stage's ordered list of (kind, microbatch) actions as early as possible.

    Stage s may run F(i) one step after stage s-1 ran F(i); B(i) one step after stage s+1
    ran B(i) (or, on the last stage, one step after its own F(i)). A stage runs its actions
    strictly in the given order, idling while the next one waits for its input.
    """
    device_orders = [[(k, s, i) for k, i in order] for s, order in enumerate(orders)]
    return from_device_orders(device_orders, len(orders), num_microbatches, name)


def from_device_orders(orders: list[list[tuple[int, int, int]]], num_stages: int,
                       num_microbatches: int, name: str) -> Schedule:
    """`from_stage_orders` for devices that run several (virtual) stages: each device's
    ordered list of (kind, stage, microbatch), timed as early as possible, one action per
    device and step. The dependencies are between stages, whichever device runs them."""
    p = num_stages
    check_sizes(p, num_microbatches)
    done: dict[tuple[int, int, int], int] = {}  # (stage, kind, mb) -> step it ran
    pos = [0] * len(orders)
    rows_kind, rows_mb = [], []
    total = sum(len(o) for o in orders)
    t = 0
    while len(done) < total:
        row_k, row_m = [IDLE] * p, [-1] * p
        for d, order in enumerate(orders):
            if pos[d] == len(order):
                continue
            kind, s, mb = order[pos[d]]
            if s % len(orders) != d:
                raise ValueError(f"orders[{d}] holds stage {s}, which runs on device "
                                 f"{s % len(orders)} (stage s runs on device s % devices)")
            if kind == FORWARD:
                dep = (s - 1, FORWARD, mb) if s > 0 else None
            elif kind == BACKWARD:
                dep = (s + 1, BACKWARD, mb) if s < p - 1 else (s, FORWARD, mb)
            elif kind == WEIGHT:
                dep = (s, BACKWARD, mb)
            else:
                raise ValueError(f"orders[{d}] holds kind={kind}; use FORWARD, BACKWARD or "
                                 "WEIGHT")
            if dep is None or done.get(dep, t) < t:
                row_k[s], row_m[s] = kind, mb
                pos[d] += 1
        for s in range(p):
            if row_k[s] != IDLE:
                done[(s, row_k[s], row_m[s])] = t
        if all(k == IDLE for k in row_k):
            raise ValueError(f"stage orders of schedule {name!r} deadlock at step {t}")
        rows_kind.append(row_k)
        rows_mb.append(row_m)
        t += 1
    sched = Schedule(
        name,
        np.asarray(rows_kind, np.int32).reshape(-1, p),
        np.asarray(rows_mb, np.int32).reshape(-1, p),
        int(num_microbatches),
        len(orders),
    )
    validate(sched)
    return sched


def validate(schedule: Schedule) -> None:
    """Raises ValueError unless every stage forwards then backwards each microbatch once,
    after its neighbour did (F after stage s-1's F, B after stage s+1's B), and - in a split
    schedule - runs its weight step W once, after its B; and unless every device runs at
    most one of its (virtual) stages' actions per step."""
    kind, mb = schedule.kind, schedule.microbatch
    if kind.ndim != 2 or kind.shape != mb.shape:
        raise ValueError(f"schedule {schedule.name!r}: kind and microbatch must be [steps, stages]")
    p, m = schedule.num_stages, schedule.num_microbatches
    devices = schedule.num_devices
    if not 1 <= devices <= p or p % devices:
        raise ValueError(f"schedule {schedule.name!r}: num_devices={devices} must divide its "
                         f"{p} stages")
    busy = (kind != IDLE).reshape(len(kind), -1, devices).sum(1)  # [steps, devices]
    if (busy > 1).any():
        t, d = (int(a[0]) for a in np.nonzero(busy > 1))
        raise ValueError(f"schedule {schedule.name!r}: device {d} runs {int(busy[t, d])} "
                         f"actions at step {t}; a device runs one action per step")
    times = np.full((3, p, m), -1)
    for t, s in zip(*np.nonzero(kind != IDLE), strict=True):
        k, i = int(kind[t, s]), int(mb[t, s])
        if k not in (FORWARD, BACKWARD, WEIGHT) or not 0 <= i < m:
            raise ValueError(f"schedule {schedule.name!r}: bad action ({k}, {i}) at step {t}")
        if times[k - 1, s, i] >= 0:
            raise ValueError(f"schedule {schedule.name!r}: stage {s} repeats ({k}, {i})")
        times[k - 1, s, i] = t
    fwd, bwd, wgt = times
    if (fwd < 0).any() or (bwd < 0).any() or (schedule.split and (wgt < 0).any()):
        raise ValueError(f"schedule {schedule.name!r} misses some (stage, microbatch) action")
    if (fwd[1:] <= fwd[:-1]).any() or (bwd[:-1] <= bwd[1:]).any() or (bwd[-1] <= fwd[-1]).any():
        raise ValueError(f"schedule {schedule.name!r} breaks a cross-stage dependency")
    if schedule.split and (wgt <= bwd).any():
        raise ValueError(f"schedule {schedule.name!r} runs a weight step before its backward")


def action_times(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(forward_step, backward_step), each [stages, microbatches]."""
    fwd, bwd, _ = all_action_times(schedule)
    return fwd, bwd


def all_action_times(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward, backward, weight step) [stages, microbatches]; weight = backward when the
    schedule does not split its backwards (the weight gradient comes with B)."""
    p, m = schedule.num_stages, schedule.num_microbatches
    times = np.zeros((4, p, m), np.int64)
    t, s = np.nonzero(schedule.kind != IDLE)
    times[schedule.kind[t, s], s, schedule.microbatch[t, s]] = t
    weight = times[WEIGHT] if schedule.split else times[BACKWARD]
    return times[FORWARD], times[BACKWARD], weight
