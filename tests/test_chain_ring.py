"""The decode megakernel's waits on its weight ring (`pallas_kernels.chain.ring`), replayed on
the CPU: a block's issues over a whole greedy call (layers, attention, the output layer
uncapped, several steps), each wait where the kernel's producer makes it."""
import itertools
import random

import pytest

from pallas_kernels.chain import ring as rw


def replay(segments, st, cap, uneven=False, head_wait=rw.head_wait, head_tail=rw.head_tail):
    """The producer's events for one block: segments [(n ring steps, is the free head)], in
    issue order over the call. Returns [("wait", x) | ("issue", j)], as `kernel.issue` and
    `kernel.produce_head` make them (`landed`: no waits where an uneven block's cap is 0)."""
    events, j = [], 0
    lag = uneven or cap > 0  # `kernel.produce_head`'s: the head defers waits only under a cap

    def wait(x, due):
        if due and (cap > 0 or not uneven):
            events.append(("wait", int(x)))

    for n, free_head in segments:
        h0 = j
        for q in range(n):
            if free_head:
                if lag:
                    wait(*head_wait(h0, q, st, cap))
            elif cap or uneven:
                wait(*rw.capped_wait(j, cap, uneven))
            events.append(("issue", j))
            j += 1
        if free_head and lag:
            lo, hi = head_tail(h0, j, st, cap)
            for x in range(int(lo), int(hi)):
                wait(x, True)
    return events, j


def check(events, total, st, cap):
    """Each step's phase waited once, in order, before its slot's next issue; every step but
    the last `cap` waited; a capped issue j only after step j - cap."""
    waits = [x for kind, x in events if kind == "wait"]
    assert waits == list(range(len(waits))), waits  # once each, in order, none skipped
    assert len(waits) == (max(total - cap, 0) if cap else 0), (len(waits), total)
    issued = set()
    for kind, x in events:
        if kind == "issue":
            issued.add(x)
        else:
            assert x + st not in issued, f"step {x} waited after its slot's next issue"


def call_segments(rng, steps, st, heads):
    """A greedy call's segments for one block: per step, its layers' products and attention
    (some empty: a block outside a product's rectangle) and the uncapped head."""
    segs = []
    for _ in range(steps):
        segs += [(rng.choice([0, 0, 1, 2, 3, 5, 9, 17]), False) for _ in range(rng.randint(1, 9))]
        segs.append((heads, True))
    return segs


@pytest.mark.parametrize("st", [2, 3, 4, 6, 8])
def test_every_phase_is_waited_once_in_order_before_its_slot_is_reused(st):
    rng = random.Random(st)
    for cap, heads, steps in itertools.product(range(st), range(1, st + 1), (1, 2, 4)):
        for _ in range(4):
            segs = call_segments(rng, steps, st, heads)
            events, total = replay(segs, st, cap)
            check(events, total, st, cap)
    for heads in range(1, st + 1):  # an uneven block without a cap: no waits at all
        events, total = replay(call_segments(rng, 3, st, heads), st, 0, uneven=True)
        check(events, total, st, 0)


def test_the_check_finds_a_schedule_that_breaks_the_rules():
    """The replay's check is not vacuous: without the tail's waits a phase is skipped, and
    with a wait deferred one step too late a slot is reused first."""
    st, cap = 4, 2
    segs = [(5, False), (3, True), (6, False)]
    with pytest.raises(AssertionError):
        check(*replay(segs, st, cap, head_tail=lambda h0, h1, st, cap: (0, 0)), st, cap)
    late = lambda h0, q, st, cap: rw.head_wait(h0, q - 1, st, cap)  # noqa: E731
    with pytest.raises(AssertionError):
        check(*replay(segs, st, cap, head_wait=late), st, cap)
