"""TeraPipe equals the plain transformer; its slice planner is optimal; its table is right.

The equality runs fill bubbles and the padding of short slices with NaN, so a slice that
reads a neighbour's padding or a bubble poisons the loss.
"""

import functools
import itertools

import jax
import numpy as np
import pytest
from helpers import assert_trees_close as trees_close
from helpers import mesh_of, small_config

from gendist.data.batches import TextData, shard_batch
from gendist.models import transformer
from gendist.parallel.pipeline import schedules as S
from gendist.parallel.pipeline import stats as SS
from gendist.parallel.pipeline import terapipe as tp
from gendist.presets import replace
from gendist.training import train

RTOL, LEAF_ATOL = 1e-5, 1e-6  # fp32; near-zero entries measured against the leaf's largest
SEQ = 16
NAN = float("nan")


@pytest.fixture(scope="module")
def corpus():
    return TextData.from_config(small_config().data)


assert_trees_close = functools.partial(trees_close, rtol=RTOL,
                                       leaf_atol=LEAF_ATOL)


# (pipeline stages, slices): 1, 2 and 4 equal slices, and uneven ones with a 1-token slice;
# p = 4 once, for the middle stages' branches.
CASES = [(4, (8, 8)), (2, (5, 3, 7, 1))]  # 4 stages, and uneven slices (TeraPipe x tensor: test_compose)


@pytest.mark.parametrize("stages, slices", CASES)
def test_loss_and_grads_match_plain_model(corpus, stages, slices):
    cfg = replace(small_config(), **{"model.num_layers": stages, "model.vocab_size": 64,
                                     "train.seq_len": SEQ})
    data = 8 // stages
    mesh = mesh_of(8, data=data, pipeline=stages)
    b = corpus.global_batch(len(slices), data, SEQ)
    batch = {k: (v % 64).astype(np.int32) for k, v in b.items()}
    params = transformer.init_params(cfg.model, 0)
    loss, grads = jax.jit(lambda p, b: tp.terapipe_loss_and_grads(
        cfg, p, b, mesh=mesh, slices=slices, bubble_value=NAN))(params, shard_batch(batch, mesh))
    want_loss, want_grads = jax.jit(jax.value_and_grad(
        lambda p, b: train.loss_fn(cfg, p, b)))(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads)


def test_schedule_runs_slices_in_order_and_backwards_reversed():
    for p, k in itertools.product(range(1, 5), range(1, 7)):
        sched = tp.terapipe_schedule(p, k)
        fwd, bwd = S.action_times(sched)
        assert (np.diff(fwd, axis=1) > 0).all()  # slice j after slice j-1 on each stage
        assert (np.diff(bwd, axis=1) < 0).all()  # backwards in reverse slice order
        assert bwd.min() > fwd.max(axis=1).min()  # all forwards before any backward
        assert SS.bubble_fraction(sched) == pytest.approx(SS.analytic_bubble_fraction(p, k))
        makespan, idle = SS.weighted_timeline(sched, np.ones(k), np.ones(k))
        assert makespan == sched.num_steps and idle == pytest.approx(SS.bubble_fraction(sched))


def context_cost(n, overhead=1.5, attn=0.3):
    """A slice costs a fixed overhead, per-token work, and attention over its context."""
    cost = np.full((n + 1, n + 1), np.inf)
    for l, c in itertools.product(range(1, n + 1), range(n)):
        if l + c <= n:
            cost[l, c] = overhead + l * (1.0 + attn * (c + (l + 1) / 2))
    return cost


def compositions(n):
    for cuts in itertools.product((0, 1), repeat=n - 1):
        out, run = [], 1
        for c in cuts:
            if c:
                out.append(run)
                run = 1
            else:
                run += 1
        yield tuple(out + [run])


@pytest.mark.parametrize("n, stages", [(6, 2), (8, 4), (9, 3)])
def test_slice_plan_is_optimal_and_beats_equal_slices(n, stages):
    rng = np.random.default_rng(n)
    for cost in (context_cost(n), context_cost(n, overhead=0.2, attn=1.0),
                 context_cost(n) * rng.uniform(0.8, 1.2, (n + 1, n + 1))):
        got = tp.plan_slices(cost, stages)
        assert sum(got) == n and min(got) >= 1
        brute = min(tp.slicing_latency(s, cost, stages) for s in compositions(n))
        assert tp.slicing_latency(got, cost, stages) == pytest.approx(brute, rel=1e-12)
    cost = context_cost(n)
    got = tp.plan_slices(cost, stages)
    equal = min(tp.slicing_latency(tp.equal_slices(n, k), cost, stages)
                for k in range(1, n + 1) if n % k == 0)
    assert tp.slicing_latency(got, cost, stages) < equal  # uneven slices win on this profile
    assert got[0] > got[-1]  # later slices see more context, so they are shorter


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="slices"):
        tp.check_slices((4, 4), 16)
    with pytest.raises(ValueError, match="slices"):
        tp.check_slices((16, 0), 16)
    with pytest.raises(ValueError, match="num_slices"):
        tp.equal_slices(4, 5)
    assert tp.equal_slices(10, 3) == (4, 3, 3)


def test_cost_fit_recovers_the_model_and_keeps_absent_entries():
    n = 6
    cost = context_cost(n, overhead=0.7, attn=0.25)  # 0.7 + l + 0.25 * l * (c + l/2 + 1/2)
    fitted = tp.fit_slice_costs(cost)
    np.testing.assert_allclose(fitted[np.isfinite(cost)], cost[np.isfinite(cost)], rtol=1e-9)
    assert np.isinf(fitted[~np.isfinite(cost)]).all()
