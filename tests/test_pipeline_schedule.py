"""Static schedule tables: dependency order, in-flight counts, bubble, buffer plan."""

import numpy as np
import pytest

from gendist.parallel import schedule as S
from gendist.parallel import schedule_stats as SS

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
        plan = S.buffer_plan(sched)
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
    assert S.buffer_plan(S.one_f_one_b(4, 12)).num_slots == 4
    assert S.buffer_plan(S.gpipe(4, 12)).num_slots == 12


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
    plan = S.buffer_plan(sched)
    fwd, _, wgt = S.all_action_times(sched)
    for s in range(4):
        for i in range(8):
            for j in range(8):
                if i != j and plan.slot[fwd[s, i], s] == plan.slot[fwd[s, j], s]:
                    # two microbatches share a slot only when their lives do not overlap
                    assert wgt[s, i] < fwd[s, j] or wgt[s, j] < fwd[s, i], (s, i, j)
