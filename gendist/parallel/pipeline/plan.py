"""Where each device keeps and receives the microbatches a schedule table holds: a
`BufferPlan` gives every (step, stage) of a validated `schedule.Schedule` the buffer slot
its action reads and the slots that the activation and cotangent arriving at that step land
in, coloured greedily so that a stage (or a device's chunks together) uses no more slots
than the microbatches it holds at once; a `DevicePlan` folds that [steps, stages] view onto
the devices ([steps, devices] columns, with the chunk that acts) for the executor
(`gendist.parallel.pipeline.core`). The tables themselves are built in
`gendist.parallel.pipeline.schedules`."""

from __future__ import annotations

import dataclasses

import numpy as np

from gendist.parallel.pipeline.table import IDLE, Schedule, all_action_times, validate


@dataclasses.dataclass(frozen=True, eq=False)
class BufferPlan:
    """Where each stage keeps the microbatches it holds, for the executor.

    A stage holds microbatch i from the step its input arrives (or, on stage 0, from its
    forward) to its backward, where the input is recomputed through (the cotangent lands
    in the same slot). Slots are reused greedily, so `num_slots` is the largest number of
    inputs any stage holds at once - any device, when it runs several (virtual) stages:
    their inputs share the device's slots. Index `num_slots` is a spare slot: idle stages
    read it and messages nobody waits for are written to it.
    """

    num_slots: int
    slot: np.ndarray  # [steps, stages] slot the action at (t, s) reads
    recv_act_slot: np.ndarray  # [steps, stages] slot for the activation arriving at step t
    recv_cot_slot: np.ndarray  # [steps, stages] slot for the cotangent arriving at step t


def buffer_plan(schedule: Schedule) -> BufferPlan:
    """Assigns buffer slots to a validated schedule by greedy interval colouring."""
    validate(schedule)
    p, m, n = schedule.num_stages, schedule.num_microbatches, schedule.num_steps
    fwd, bwd, done = all_action_times(schedule)
    start = np.concatenate([fwd[:1], fwd[:-1] + 1], axis=0)  # arrival step [stages, mbs]
    slot_of = np.zeros((p, m), np.int64)
    num_slots = 1
    devices = schedule.num_devices
    for d in range(devices):  # the stages of one device (its chunks) share its slots
        free_at: list[int] = []  # free_at[k]: first step slot k may take a new microbatch
        for _, s, i in sorted((start[s, i], s, i) for s in range(d, p, devices)
                              for i in range(m)):
            k = next((k for k, f in enumerate(free_at) if f <= start[s, i]), len(free_at))
            if k == len(free_at):
                free_at.append(0)
            free_at[k] = done[s, i] + 1  # held until its backward (weight step if split)
            slot_of[s, i] = k
        num_slots = max(num_slots, len(free_at))
    spare = num_slots
    slot = np.full((n, p), spare, np.int32)
    t, s = np.nonzero(schedule.kind != IDLE)
    slot[t, s] = slot_of[s, schedule.microbatch[t, s]]
    recv_act = np.full((n + 1, p), spare, np.int32)
    recv_cot = np.full((n + 1, p), spare, np.int32)
    for s in range(1, p):
        recv_act[fwd[s - 1] + 1, s] = slot_of[s]
    for s in range(p - 1):
        recv_cot[bwd[s + 1] + 1, s] = slot_of[s]
    return BufferPlan(num_slots, slot, recv_act[:n], recv_cot[:n])


@dataclasses.dataclass(frozen=True, eq=False)
class DevicePlan:
    """The executor's per-device view of a schedule: [steps, devices] columns.

    Slots are `buffer_plan`'s (a device's chunks share them); index `num_slots` is the
    spare. On a schedule with one stage per device this is `buffer_plan` as is.
    """

    num_slots: int
    stage: np.ndarray  # [steps, devices] the (virtual) stage acting, -1 when idle
    kind: np.ndarray  # [steps, devices] its action (IDLE when idle)
    microbatch: np.ndarray  # [steps, devices] its microbatch (-1 when idle)
    chunk: np.ndarray  # [steps, devices] its chunk, stage // devices (0 when idle)
    slot: np.ndarray  # [steps, devices] slot the action reads (the spare when idle)
    recv_act_slot: np.ndarray  # [steps, devices] slot of the activation arriving at step t
    recv_cot_slot: np.ndarray  # [steps, devices] slot of the cotangent arriving at step t


def device_plan(schedule: Schedule) -> DevicePlan:
    """Folds the [steps, stages] table and its buffer plan onto the devices: stage s runs on
    device s % devices as chunk s // devices. Activations then always move to the next
    device, from the last device to device 0 between chunks (a ring), cotangents back."""
    plan = buffer_plan(schedule)
    n, p, d = schedule.num_steps, schedule.num_stages, schedule.num_devices
    spare = plan.num_slots
    chunk_of = np.arange(p) // d

    def fold(table, fill, active):  # [steps, stages] -> [steps, devices], one active each
        out = np.full((n, d), fill, np.int32)
        t, s = np.nonzero(active)
        if len(set(zip(t.tolist(), (s % d).tolist(), strict=True))) != len(t):
            raise ValueError(f"schedule {schedule.name!r}: two messages reach one device in "
                             "one step")
        out[t, s % d] = table[t, s]
        return out

    busy = schedule.kind != IDLE
    stage = np.broadcast_to(np.arange(p, dtype=np.int32), (n, p))
    return DevicePlan(
        num_slots=spare,
        stage=fold(stage, -1, busy),
        kind=fold(schedule.kind, IDLE, busy),
        microbatch=fold(schedule.microbatch, -1, busy),
        chunk=fold(np.broadcast_to(chunk_of, (n, p)), 0, busy),
        slot=fold(plan.slot, spare, busy),
        recv_act_slot=fold(plan.recv_act_slot, spare, plan.recv_act_slot != spare),
        recv_cot_slot=fold(plan.recv_cot_slot, spare, plan.recv_cot_slot != spare))
