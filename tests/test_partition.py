"""Stage partitioning: the dynamic programme equals brute force; profiling measures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.parallel.pipeline import partition as part


def _random_problems(seed=0, count=300):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 9))
        p = int(rng.integers(1, n + 1))
        kw = dict(first_time=float(rng.uniform(0, 3)), last_time=float(rng.uniform(0, 3)))
        if rng.random() < 0.6:
            mem = rng.uniform(0, 5, n)
            kw |= dict(layer_memory=mem, first_memory=float(rng.uniform(0, 3)),
                       last_memory=float(rng.uniform(0, 3)),
                       memory_cap=float(rng.uniform(mem.max(), mem.sum() + 6)))
        yield rng.uniform(0.1, 5, n), p, kw


def test_dp_equals_brute_force_and_respects_the_cap():
    feasible = infeasible = 0
    for times, p, kw in _random_problems():
        try:
            want = part.brute_force_partition(times, p, **kw)
        except ValueError as e:
            assert "memory_cap" in str(e)
            with pytest.raises(ValueError, match="memory_cap"):
                part.partition_layers(times, p, **kw)
            infeasible += 1
            continue
        got = part.partition_layers(times, p, **kw)
        feasible += 1
        assert got.bottleneck == pytest.approx(want.bottleneck, rel=1e-12), (times, p, kw)
        assert sum(got.counts) == len(times) and len(got.counts) == p and min(got.counts) >= 1
        assert max(got.stage_memory) <= kw.get("memory_cap", np.inf)
        # The reported stage costs are the costs of the reported split.
        bounds = np.cumsum((0,) + got.counts)
        extra = np.zeros(p)
        extra[0] += kw["first_time"]
        extra[-1] += kw["last_time"]
        for k in range(p):
            assert got.stage_time[k] == pytest.approx(times[bounds[k]:bounds[k + 1]].sum() + extra[k])
    assert feasible > 100 and infeasible > 5  # both paths exercised


def test_expensive_ends_get_fewer_layers():
    got = part.partition_layers([1.0] * 8, 4, first_time=2.0, last_time=1.0)
    assert got.bottleneck == 3.0  # 11 units over 4 stages; the embedding forces 1 layer
    assert got.counts[0] == 1


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="layer_time"):
        part.partition_layers([1.0, 1.0], 3)
    with pytest.raises(ValueError, match="num_stages"):
        part.partition_layers([1.0, 1.0], 0)
    with pytest.raises(ValueError, match="layer_memory"):
        part.partition_layers([1.0, 1.0], 2, layer_memory=[1.0])
    with pytest.raises(ValueError, match="memory_cap"):
        part.partition_layers([1.0, 1.0], 2, layer_memory=[3.0, 1.0], memory_cap=2.0)


def _mlp_layer(layer, x_BD):
    return x_BD + jnp.tanh(x_BD @ layer["w1"]) @ layer["w2"]


def test_profile_reads_memory_and_time_from_the_device():
    x_BD = jnp.ones((8, 16))
    small = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 16))}
    big = {"w1": jnp.ones((16, 512)), "w2": jnp.ones((512, 16))}
    c_small = part.profile_fwd_bwd(_mlp_layer, small, x_BD, repeats=2)
    c_big = part.profile_fwd_bwd(_mlp_layer, big, x_BD, repeats=2)
    assert c_small.time_s > 0
    param_grad_bytes = 2 * 4 * (16 * 512 * 2)  # big params in, their gradients out
    assert c_big.memory_bytes >= param_grad_bytes > c_small.memory_bytes


def test_profile_model_then_plan():
    d, v, n = 16, 32, 3
    params = {
        "embed": {"tok": jnp.ones((v, d))},
        "layers": {"w1": jnp.ones((n, d, 32)) / 32, "w2": jnp.ones((n, 32, d)) / 32},
        "head": {"w": jnp.ones((d, v)) / d},
    }
    tokens = jnp.zeros((2, 4), jnp.int32)

    def head_loss(h, x, t):
        logp = jax.nn.log_softmax(x @ h["w"])
        return -jnp.take_along_axis(logp, t[..., None], -1).sum(), t.size

    embed, layers, head = part.profile_model(
        params, tokens, tokens, embed_fn=lambda e, t: e["tok"][t], layer_fn=_mlp_layer,
        head_loss_fn=head_loss, repeats=1)
    assert len(layers) == n and all(c.time_s > 0 and c.memory_bytes > 0 for c in layers)
    plan = part.plan_stages(embed, layers, head, 2)
    assert sum(plan.counts) == n and len(plan.counts) == 2


def test_lockstep_step_time_by_hand_and_for_the_sequential_schedule():
    from gendist.parallel.pipeline import schedules as S
    # gpipe p=2, m=2: F0 F1 . . B0 B1 / . F0 F1 B0 B1 .; stage times 3, 6 -> F 1, 2; B 2, 4
    # without recomputation, B 3, 6 when the backward recomputes the forward.
    g = S.gpipe(2, 2)
    assert part.lockstep_step_time(g, [3.0, 6.0], recompute=False) == 1 + 2 + 2 + 4 + 4 + 2
    assert part.lockstep_step_time(g, [3.0, 6.0]) == 1 + 2 + 2 + 6 + 6 + 3
    assert part.lockstep_step_time(g, [3.0, 6.0], [2.0, 1.0]) == 2 + 2 + 1 + 6 + 6 + 3
    # One stage at a time: the barrier costs nothing, the step is m times the total work.
    assert part.lockstep_step_time(S.sequential(3, 4), [1.0, 2.0, 5.0],
                                   recompute=False) == pytest.approx(4 * 8.0)
    with pytest.raises(ValueError, match="stage_time"):
        part.lockstep_step_time(S.gpipe(2, 2), [1.0, 2.0, 3.0])


def test_lockstep_partition_is_the_best_split_under_barriers():
    from gendist.parallel.pipeline import schedules as S
    rng = np.random.default_rng(0)
    sched = S.one_f_one_b(3, 7)
    for _ in range(10):
        t = rng.uniform(0.1, 3.0, 7)
        tf = t * rng.uniform(0.2, 0.5, 7)  # measured forward times
        split, value = part.partition_layers_lockstep(t, sched, layer_fwd_time=tf)
        bounds = np.cumsum((0,) + split.counts)
        stage_t = lambda x, b: [x[b[k]:b[k + 1]].sum() for k in range(3)]  # noqa: E731
        assert value == pytest.approx(part.lockstep_step_time(
            sched, stage_t(t, bounds), stage_t(tf, bounds)))
        for counts in ((2, 2, 3), (1, 3, 3), (3, 3, 1), (5, 1, 1)):
            b = np.cumsum((0,) + counts)
            other = part.lockstep_step_time(sched, stage_t(t, b), stage_t(tf, b))
            assert value <= other + 1e-12
    # Two heavy layers: the uniform split loads stage 1 with both and loses under barriers.
    w = [1, 1, 1, 1, 6, 6, 1, 1]
    split, value = part.partition_layers_lockstep(w, S.one_f_one_b(2, 8), recompute=False)
    assert split.counts == (5, 3)
    assert value < part.lockstep_step_time(S.one_f_one_b(2, 8), [4.0, 14.0], recompute=False)
    with pytest.raises(ValueError, match="max_splits"):
        part.partition_layers_lockstep(np.ones(40), S.one_f_one_b(8, 8), max_splits=1000)


def test_evaluate_split_costs_a_given_split_as_the_planner_does():
    costs = [part.Cost(t, m, t / 3) for t, m in ((0.5, 10), (1, 1), (2, 2), (6, 3), (1, 4),
                                                  (0.7, 20))]
    embed, layers, head = costs[0], costs[1:-1], costs[-1]
    plan = part.plan_stages(embed, layers, head, 2)
    assert part.evaluate_split(embed, layers, head, plan.counts) == plan
    assert all(type(n) is int for n in part.evaluate_split(embed, layers, head, (2, 2)).counts)
    uniform = part.evaluate_split(embed, layers, head, (2, 2))
    assert uniform.stage_time == pytest.approx((0.5 + 1 + 2, 6 + 1 + 0.7))
    assert uniform.stage_memory == (10 + 1 + 2, 3 + 4 + 20)
    fwd = part.evaluate_split(embed, layers, head, (2, 2), forward=True)
    assert fwd.stage_time == pytest.approx((3.5 / 3, 7.7 / 3))
