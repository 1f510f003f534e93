"""Static schedule tables: dependency order, in-flight counts, bubble, buffer plan."""

import numpy as np
import pytest

from gendist.parallel.pipeline import plan as SP
from gendist.parallel.pipeline import schedules as S
from gendist.parallel.pipeline import stats as SS

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]
BUILDERS = [S.gpipe, S.one_f_one_b, S.one_f_one_b_phased]


def _times(sched):
    """(forward, backward) step of each (stage, microbatch), checking each appears once."""
    p, m = sched.num_stages, sched.num_microbatches
    seen = {}
    for t in range(sched.num_steps):
        for s in range(p):
            k, i = int(sched.kind[t, s]), int(sched.microbatch[t, s])
            if k == S.IDLE:
                assert i == -1
                continue
            assert (s, k, i) not in seen, f"stage {s} repeats {(k, i)}"
            seen[(s, k, i)] = t
    assert len(seen) == 2 * p * m
    fwd = np.array([[seen[(s, S.FORWARD, i)] for i in range(m)] for s in range(p)])
    bwd = np.array([[seen[(s, S.BACKWARD, i)] for i in range(m)] for s in range(p)])
    return fwd, bwd


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_every_microbatch_once_in_dependency_order(build):
    for p, m in GRID:
        sched = build(p, m)
        fwd, bwd = _times(sched)
        assert (fwd[1:] > fwd[:-1]).all(), (p, m)  # F on s after F on s-1
        assert (bwd[:-1] > bwd[1:]).all(), (p, m)  # B on s after B on s+1
        assert (bwd > fwd).all(), (p, m)  # a stage's B after its own F
        assert (bwd[-1] > fwd[-1]).all()


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_bubble_from_table_equals_analytic(build):
    for p, m in GRID:
        sched = build(p, m)
        assert sched.num_steps == 2 * (m + p - 1), (p, m)
        idle = int((sched.kind == S.IDLE).sum())
        assert idle == 2 * p * (p - 1), (p, m)
        assert SS.bubble_fraction(sched) == pytest.approx(SS.analytic_bubble_fraction(p, m), abs=1e-12)


def test_in_flight_is_p_for_1f1b_and_m_for_gpipe():
    for p, m in GRID:
        assert SS.max_in_flight(S.gpipe(p, m)) == m, (p, m)
        assert SS.max_in_flight(S.one_f_one_b(p, m)) == min(p, m), (p, m)
        # Stage s of 1F1B holds at most p - s microbatches.
        per_stage = SS.in_flight_per_stage(S.one_f_one_b(p, m))
        np.testing.assert_array_equal(per_stage, np.minimum(p - np.arange(p), m))


@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_buffer_plan_never_overwrites_a_held_input(build):
    """Replays the plan: a slot written by an arrival is only read back by its own owner."""
    for p, m in GRID:
        sched = build(p, m)
        plan = SP.buffer_plan(sched)
        assert plan.num_slots == SS.max_in_flight(sched), (p, m)
        fwd, bwd = _times(sched)
        for s in range(p):
            holder = {}  # slot -> microbatch whose input it holds
            for t in range(sched.num_steps):
                arrived = [i for i in range(m) if s > 0 and fwd[s - 1, i] + 1 == t]
                cot = [i for i in range(m) if s < p - 1 and bwd[s + 1, i] + 1 == t]
                if arrived:
                    holder[int(plan.recv_act_slot[t, s])] = arrived[0]
                else:
                    assert plan.recv_act_slot[t, s] == plan.num_slots
                if cot:
                    assert holder.get(int(plan.recv_cot_slot[t, s]), cot[0]) == cot[0]
                k, i = int(sched.kind[t, s]), int(sched.microbatch[t, s])
                if k == S.FORWARD and s == 0:
                    holder[int(plan.slot[t, s])] = i
                if k != S.IDLE and s > 0:
                    assert holder[int(plan.slot[t, s])] == i, (p, m, s, t)
                if k == S.IDLE:
                    assert plan.slot[t, s] == plan.num_slots


def test_phased_1f1b_costs_gpipe_lockstep_time_at_bounded_memory():
    """Every step runs one kind of action on all stages: on a lock-step executor (a step
    lasts its slowest action, B = 2F) the table costs GPipe's time, below 1F1B's, while
    stage s holds at most 2(p - s) - 1 microbatches (GPipe: m)."""
    for p, m in GRID:
        sched = S.one_f_one_b_phased(p, m)
        for row in sched.kind:
            assert len(set(row[row != S.IDLE].tolist())) == 1, (p, m)
        assert SS.lockstep_time(sched) == SS.lockstep_time(S.gpipe(p, m)), (p, m)
        assert SS.lockstep_time(sched) <= SS.lockstep_time(S.one_f_one_b(p, m)), (p, m)
        limit = np.minimum(2 * (p - np.arange(p)) - 1, m)
        assert (SS.in_flight_per_stage(sched) <= limit).all(), (p, m)
    # p = 2, m = 16: 51 units against 1F1B's 66; the one-device work is 3m = 48.
    assert SS.lockstep_time(S.one_f_one_b_phased(2, 16)) == 51
    assert SS.lockstep_time(S.one_f_one_b(2, 16)) == 66
    text = SS.to_text(S.one_f_one_b_phased(2, 4)).splitlines()[1:]
    assert text == ["stage 0: F0 F1 .  F2 B0 F3 B1 .  B2 B3",
                    "stage 1: .  F0 B0 F1 B1 F2 B2 F3 B3 . "]


def test_1f1b_buffer_is_p_slots_gpipe_m():
    assert SP.buffer_plan(S.one_f_one_b(4, 12)).num_slots == 4
    assert SP.buffer_plan(S.gpipe(4, 12)).num_slots == 12


def test_text_picture():
    text = SS.to_text(S.one_f_one_b(2, 2))
    assert text.splitlines()[1:] == ["stage 0: F0 F1 .  B0 .  B1", "stage 1: .  F0 B0 F1 B1 . "]


def test_plot_draws_one_patch_per_action():
    import matplotlib

    matplotlib.use("Agg")
    sched = S.gpipe(3, 4)
    ax = SS.plot(sched)
    assert len(ax.patches) == 2 * 3 * 4


@pytest.mark.parametrize(
    "args, field",
    [((0, 4), "num_stages"), ((2, 0), "num_microbatches"), ((2, 1.5), "num_microbatches")],
)
def test_bad_sizes_name_the_field(args, field):
    for build in BUILDERS:
        with pytest.raises(ValueError, match=field):
            build(*args)


def test_validate_rejects_broken_tables():
    good = S.one_f_one_b(3, 3)
    t, s = (int(v[0]) for v in np.nonzero(good.kind == S.BACKWARD))
    repeated = good.kind.copy()
    repeated[t, s] = S.FORWARD  # F twice, B never
    with pytest.raises(ValueError, match="repeats"):
        S.validate(S.Schedule("bad", repeated, good.microbatch, 3))
    dropped_kind, dropped_mb = good.kind.copy(), good.microbatch.copy()
    dropped_kind[t, s], dropped_mb[t, s] = S.IDLE, -1
    with pytest.raises(ValueError, match="misses"):
        S.validate(S.Schedule("bad", dropped_kind, dropped_mb, 3))
    early = S.Schedule("early", good.kind[::-1].copy(), good.microbatch[::-1].copy(), 3)
    with pytest.raises(ValueError, match="dependency"):
        S.validate(early)
    with pytest.raises(ValueError, match="schedule"):
        S.make("interleaved", 2, 2)


# --- split backwards: B (input gradient) and W (weight gradient) ----------------------------

SPLIT = [S.one_f_one_b_split, S.zb_h1]


def _split_times(sched):
    p, m = sched.num_stages, sched.num_microbatches
    seen = {}
    for t, s in zip(*np.nonzero(sched.kind != S.IDLE), strict=True):
        key = (int(s), int(sched.kind[t, s]), int(sched.microbatch[t, s]))
        assert key not in seen, f"repeats {key}"
        seen[key] = int(t)
    assert len(seen) == 3 * p * m
    return [np.array([[seen[(s, k, i)] for i in range(m)] for s in range(p)])
            for k in (S.FORWARD, S.BACKWARD, S.WEIGHT)]


@pytest.mark.parametrize("build", SPLIT, ids=lambda b: b.__name__)
def test_split_schedules_keep_dependencies_and_memory(build):
    for p, m in GRID:
        sched = build(p, m)
        fwd, bwd, wgt = _split_times(sched)
        assert (fwd[1:] > fwd[:-1]).all() and (bwd[:-1] > bwd[1:]).all(), (p, m)
        assert (bwd > fwd).all() and (wgt > bwd).all(), (p, m)
        assert sched.split and SS.bubble_fraction(sched) < SS.bubble_fraction(
            S.one_f_one_b(p, m)) + 1e-12, (p, m)
        # A stage holds a microbatch from its forward to its weight step.
        held = SS.in_flight_per_stage(sched)
        limit = (p - np.arange(p)) if build is S.one_f_one_b_split else np.full(p, p)
        assert (held <= np.minimum(limit, m)).all(), (p, m, held)


def test_zb_h1_bubble_against_the_paper():
    """Equal F, B, W: 3m + p - 1 steps is ZB-H1's bound (the bubble (p-1)(F+B-2W) of Qi et
    al. 2024 with their W-before-drain accounting is p - 1 steps here); the greedy table
    reaches it at p = 2 and stays within two steps at p = 4, below 1F1B-split."""
    for m in (2, 4, 8, 16):
        assert S.zb_h1(2, m).num_steps == 3 * m + 1
        assert S.zb_h1(4, m).num_steps <= 3 * m + 3 + 2
        assert S.zb_h1(4, m).num_steps < S.one_f_one_b_split(4, m).num_steps or m < 4
    # 1F1B-split: 1F1B's order with W right after B: 3(m + p - 1) steps - 1 (the last W).
    assert S.one_f_one_b_split(2, 16).num_steps == 50


def test_split_buffer_plan_holds_slots_until_the_weight_step():
    sched = S.zb_h1(4, 8)
    plan = SP.buffer_plan(sched)
    fwd, _, wgt = S.all_action_times(sched)
    for s in range(4):
        for i in range(8):
            for j in range(8):
                if i != j and plan.slot[fwd[s, i], s] == plan.slot[fwd[s, j], s]:
                    # two microbatches share a slot only when their lives do not overlap
                    assert wgt[s, i] < fwd[s, j] or wgt[s, j] < fwd[s, i], (s, i, j)


# --- interleaved 1F1B: v chunks of layers per device, p x v virtual stages -------------------

INTERLEAVED_GRID = [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p, 4 * p)]


def test_interleaved_1f1b_order_devices_bubble_and_memory():
    """Every (virtual stage, microbatch) F and B once in dependency order; virtual stage k on
    device k % p, one action per device and step; 2(vm + p - 1) chunk-steps, so the bubble
    is (p-1)/(vm+p-1) (Narayanan et al. 2021: 1F1B's (p-1)/m shrinks by v) and the time in
    stage-actions below 1F1B's; device d holds at most Megatron's 2(p-d-1) + (v-1)p + 1
    chunk-microbatches."""
    for p, v, m in INTERLEAVED_GRID:
        sched = S.interleaved_1f1b(p, m, v)
        assert (sched.num_stages, sched.num_devices, sched.num_chunks) == (p * v, p, v)
        fwd, bwd = _times(sched)  # each (virtual stage, microbatch) F and B exactly once
        assert (fwd[1:] > fwd[:-1]).all() and (bwd[:-1] > bwd[1:]).all(), (p, v, m)
        assert (bwd > fwd).all(), (p, v, m)
        busy = (sched.kind != S.IDLE).reshape(sched.num_steps, v, p).sum(1)  # [steps, devices]
        assert busy.max() == 1, (p, v, m)
        assert sched.num_steps == 2 * (v * m + p - 1), (p, v, m)
        assert SS.bubble_fraction(sched) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        one_f = S.one_f_one_b(p, m)
        assert SS.bubble_fraction(sched) < SS.bubble_fraction(one_f), (p, v, m)
        assert SS.stage_time(sched) < SS.stage_time(one_f) == one_f.num_steps, (p, v, m)
        # With chunk-actions costing 1/v, the timeline is the table's, in stage-actions.
        makespan, idle = SS.weighted_timeline(sched, 1 / v, 1 / v)
        assert makespan == pytest.approx(SS.stage_time(sched))
        assert idle == pytest.approx(SS.bubble_fraction(sched))
        warm = np.minimum(2 * (p - 1 - np.arange(p)) + (v - 1) * p, m * v)
        assert (SS.in_flight_per_device(sched) <= warm + 1).all(), (p, v, m)


def test_interleaved_bubble_p2_m16():
    """The figures of the report: p = 2, m = 16, v = 2 against 1F1B."""
    il, one_f = S.make("interleaved-1f1b", 2, 16, 2), S.one_f_one_b(2, 16)
    assert (il.num_steps, SS.stage_time(il)) == (66, 33.0)  # chunk-steps, stage-actions
    assert one_f.num_steps == 34
    assert SS.bubble_fraction(il) == pytest.approx(1 / 33)
    assert SS.bubble_fraction(one_f) == pytest.approx(1 / 17)
    lines = SS.pipeline_plan_lines(2, 16, "interleaved-1f1b", num_chunks=2)
    assert "4/132 idle device-steps = 0.0303" in lines[1] and "0.0303" in lines[2]


def _replay_device_plan(sched):
    """Replays `device_plan` on each device: every arriving activation / cotangent lands in
    a slot the device then reads for exactly that (virtual stage, microbatch), and no
    arrival overwrites an input still held."""
    plan = SP.device_plan(sched)
    p, n = sched.num_devices, sched.num_steps
    assert plan.num_slots == SS.in_flight_per_device(sched).max()  # chunks share slots
    fwd, bwd = S.action_times(sched)
    for d in range(p):
        holder = {}  # slot -> (stage, microbatch) held there
        for t in range(n):
            arrivals = [(k, i) for k in range(d, sched.num_stages, p) if k > 0
                        for i in range(sched.num_microbatches) if fwd[k - 1, i] + 1 == t]
            assert len(arrivals) <= 1
            if arrivals:
                slot = int(plan.recv_act_slot[t, d])
                assert slot < plan.num_slots and slot not in holder, (d, t)
                holder[slot] = arrivals[0]
            else:
                assert plan.recv_act_slot[t, d] == plan.num_slots
            cots = [(k, i) for k in range(d, sched.num_stages, p) if k < sched.num_stages - 1
                    for i in range(sched.num_microbatches) if bwd[k + 1, i] + 1 == t]
            if cots:
                assert holder[int(plan.recv_cot_slot[t, d])] == cots[0], (d, t)
            k, i = int(plan.stage[t, d]), int(plan.microbatch[t, d])
            if k < 0:
                assert plan.slot[t, d] == plan.num_slots and plan.kind[t, d] == S.IDLE
                continue
            assert k % p == d and plan.chunk[t, d] == k // p
            assert plan.kind[t, d] == sched.kind[t, k]
            slot = int(plan.slot[t, d])
            if k == 0 and plan.kind[t, d] == S.FORWARD:
                holder[slot] = (k, i)
            assert holder[slot] == (k, i), (d, t)
            if plan.kind[t, d] == S.BACKWARD:
                del holder[slot]
        assert not holder


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (3, 2, 6), (4, 3, 8), (2, 3, 2)])
def test_device_plan_never_overwrites_a_held_input(p, v, m):
    _replay_device_plan(S.interleaved_1f1b(p, m, v))
    _replay_device_plan(S.one_f_one_b(p, m))  # one chunk: the buffer plan as it was
    plan, old = SP.device_plan(S.one_f_one_b(p, m)), SP.buffer_plan(S.one_f_one_b(p, m))
    np.testing.assert_array_equal(plan.slot, old.slot)
    np.testing.assert_array_equal(plan.recv_act_slot, old.recv_act_slot)


def test_interleaved_text_picture_and_errors():
    text = SS.to_text(S.interleaved_1f1b(2, 2, 2)).splitlines()
    assert text[0].startswith("interleaved-1f1b: 2 devices x 2 chunks")
    assert text[1:] == ["stage 0: F0a F1a F0b F1b .   B0b .   B1b B0a B1a",
                        "stage 1: .   F0a F1a F0b B0b F1b B1b B0a B1a .  "]
    good = S.interleaved_1f1b(2, 4, 2)
    with pytest.raises(ValueError, match="one action per step"):
        S.validate(S.Schedule("bad", good.kind, good.microbatch, 4, num_devices=1))
    with pytest.raises(ValueError, match="train.pipeline_chunks"):
        S.make("interleaved-1f1b", 2, 4)
    with pytest.raises(ValueError, match="train.pipeline_chunks"):
        S.make("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        S.make("interleaved-1f1b", 2, 3, 2)
