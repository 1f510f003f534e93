"""The weight ring's waits: which ring step's tile the producer waits to land, and when.

A block's weight tiles pass through a ring of `st` shared-memory slots: ring step j loads
its tile into slot j mod st and completes a phase of that slot's `full` barrier when it
lands. An mbarrier wait names the phase it waits for by its parity, so the producer may wait
on step x's phase only before the slot's next step (x + st) is issued: after that the
barrier may have completed the next phase too, and a wait on the old parity would stall a
whole phase (or forever). The producer waits on each step at most once and in order.

Capped loads (`chain_mgpu(loads=cap)`, the attention blocks' own `att_loads`): before
issuing step j it waits for step j - cap, so at most `cap` tiles are in flight (cap 0: no
cap, no waits). Every step but the last `cap` of a call is waited, in order.

The output layer of a greedy call (`head_free` in the kernel: its few tiles a block fit the
ring) is issued without the cap, so that its tiles are in flight together; the waits the cap
would have made are deferred, each to the latest point it may come: before issuing head step
h0 + q, step h0 + q - st (the slot's previous step), if the cap had not already waited on
it before the head (steps below h0 - cap); after the head's last issue, the rest whose slots
are not reused, [max(h0 - cap, h1 - st, 0), h1 - cap). The head's last `cap` steps are then
waited by the next step's capped issues, as any product's are. `tests/test_chain_ring.py`
replays a call's issues through these rules and checks the order.

The functions take Python ints (the tests) or traced int32 (the kernel) alike.
"""
from __future__ import annotations

import jax.numpy as jnp


def capped_wait(j, cap, uneven: bool):
    """(x, due): before issuing ring step j under a cap of `cap` tiles in flight, the step
    x = j - cap is waited on where `due`. uneven: cap differs by block (traced; 0: none)."""
    return j - cap, ((cap > 0) & (j >= cap) if uneven else j >= cap)


def head_wait(h0, q, st: int, cap):
    """(x, due): before issuing the uncapped head's step h0 + q (its first ring step h0), the
    deferred wait on step x = h0 + q - st, where `due` (the cap waited on steps before h0 - cap)."""
    x = h0 + q - st
    return x, (x >= h0 - cap) & (x >= 0)


def head_tail(h0, h1, st: int, cap):
    """[lo, hi): the deferred waits after the head's last issue (its steps h0 .. h1 - 1),
    the steps whose slots the head did not reuse, except the last `cap`."""
    return jnp.maximum(jnp.maximum(h0 - cap, h1 - st), 0), h1 - cap
