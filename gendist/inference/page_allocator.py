"""Page allocator for a paged KV cache, with all state in arrays so every operation runs in jit.

PagedAttention (Kwon et al. 2023, vLLM) stores each sequence's K/V in fixed-size pages taken
from one shared pool on demand, so a sequence reserves at most one partly filled page instead
of its maximum length. Pages carry reference counts: `fork` shares a sequence's pages (parallel
sampling, a shared prompt) and a write into a shared page first copies it (copy-on-write).

Every operation is a pure function `(state, ...) -> (state, ..., status)`. `status` is an int32
scalar, `OK` (0) or the first failed check; on failure the returned state (and pools) equal
the inputs, so nothing is corrupted inside a jitted loop. `checked(op)` wraps an operation for
host code and raises `PagePoolExhausted` or `ValueError` instead of returning a status.

Pools are any arrays shaped [..., P, Z, H] (P = pages, Z = page size), e.g. the kernel's
`pages_KPZH` or a model's `pages_LKPZH`; a page is free exactly when its refcount is 0.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

NO_PAGE = -1  # block-table entry past a sequence's last page

# Status codes, in the priority order in which checks are reported.
OK, NO_PAGES, NO_SLOTS, BAD_SLOT, TOO_LONG, BAD_POSITION = range(6)
STATUS_NAMES = ("OK", "NO_PAGES", "NO_SLOTS", "BAD_SLOT", "TOO_LONG", "BAD_POSITION")


class PagePoolExhausted(RuntimeError):
    """The pool has fewer free pages than an operation needs."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageAllocatorState:
    """Allocator state; slot s is one sequence's row of `block_tables`."""

    refcounts: jax.Array  # [P] int32: sequences holding each page; 0 = free
    block_tables: jax.Array  # [max_seqs, max_pages_per_seq] int32 page ids, NO_PAGE past the end
    lengths: jax.Array  # [max_seqs] int32 tokens reserved per slot
    active: jax.Array  # [max_seqs] bool: slot holds a sequence
    page_size: int = dataclasses.field(metadata=dict(static=True))  # tokens per page (Z)

    @property
    def num_pages(self) -> int:
        return self.refcounts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def free_mask(self) -> jax.Array:
        return self.refcounts == 0

    @property
    def num_free(self) -> jax.Array:
        return jnp.sum(self.refcounts == 0, dtype=jnp.int32)


def init_allocator(num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int):
    """An empty allocator: every page free, every slot inactive."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("max_seqs", max_seqs),
                        ("max_pages_per_seq", max_pages_per_seq)):
        if int(value) < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    return PageAllocatorState(
        refcounts=jnp.zeros((num_pages,), jnp.int32),
        block_tables=jnp.full((max_seqs, max_pages_per_seq), NO_PAGE, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        active=jnp.zeros((max_seqs,), bool),
        page_size=int(page_size),
    )


# ----------------------------------------------------------------------------- helpers


def _status(*checks):
    """First failed (failed, code) pair wins; OK if none failed."""
    status = jnp.int32(OK)
    for failed, code in reversed(checks):
        status = jnp.where(failed, jnp.int32(code), status)
    return status


def _commit(status, new, old):
    """New state if status is OK, else the old one, unchanged."""
    return jax.tree.map(lambda n, o: jnp.where(status == OK, n, o), new, old)


def _cdiv(a, b):
    return (a + b - 1) // b


def _free_pages(refcounts, count: int):
    """The `count` lowest-numbered free pages; P (out of range) where there are fewer."""
    return jnp.nonzero(refcounts == 0, size=count, fill_value=refcounts.shape[0])[0].astype(jnp.int32)


def _bad_slot(state, slot):
    return (slot < 0) | (slot >= state.max_seqs) | ~state.active[jnp.clip(slot, 0, state.max_seqs - 1)]


# ----------------------------------------------------------------------------- slots


@jax.jit
def allocate_slot(state: PageAllocatorState):
    """Claims the lowest inactive slot for a new, empty sequence -> (state, slot, status)."""
    slot = jnp.argmin(state.active).astype(jnp.int32)
    status = _status((jnp.all(state.active), NO_SLOTS))
    new = dataclasses.replace(state, active=state.active.at[slot].set(True),
                              lengths=state.lengths.at[slot].set(0),
                              block_tables=state.block_tables.at[slot].set(NO_PAGE))
    return _commit(status, new, state), slot, status


@jax.jit
def fork(state: PageAllocatorState, src_slot):
    """A new slot sharing every page of `src_slot` (refcount + 1) -> (state, slot, status)."""
    dst = jnp.argmin(state.active).astype(jnp.int32)
    status = _status((_bad_slot(state, src_slot), BAD_SLOT), (jnp.all(state.active), NO_SLOTS))
    row = state.block_tables[jnp.clip(src_slot, 0, state.max_seqs - 1)]
    held = jnp.where(row >= 0, row, state.num_pages)
    new = dataclasses.replace(
        state,
        refcounts=state.refcounts.at[held].add(1, mode="drop"),
        block_tables=state.block_tables.at[dst].set(row),
        lengths=state.lengths.at[dst].set(state.lengths[jnp.clip(src_slot, 0, state.max_seqs - 1)]),
        active=state.active.at[dst].set(True))
    return _commit(status, new, state), dst, status


@jax.jit
def truncate(state: PageAllocatorState, slot, new_length):
    """Shortens a sequence to `new_length` tokens (rejected drafts); releases pages past it."""
    s = jnp.clip(slot, 0, state.max_seqs - 1)
    status = _status((_bad_slot(state, slot), BAD_SLOT),
                     ((new_length < 0) | (new_length > state.lengths[s]), BAD_POSITION))
    row = state.block_tables[s]
    drop = (jnp.arange(state.max_pages_per_seq) >= _cdiv(new_length, state.page_size)) & (row >= 0)
    new = dataclasses.replace(
        state,
        refcounts=state.refcounts.at[jnp.where(drop, row, state.num_pages)].add(-1, mode="drop"),
        block_tables=state.block_tables.at[s].set(jnp.where(drop, NO_PAGE, row)),
        lengths=state.lengths.at[s].set(new_length))
    return _commit(status, new, state), status


@jax.jit
def free(state: PageAllocatorState, slot):
    """Ends a sequence: its pages lose one owner (free at refcount 0), its slot is released."""
    state, status = truncate(state, slot, 0)
    s = jnp.clip(slot, 0, state.max_seqs - 1)
    active = state.active.at[s].set(jnp.where(status == OK, False, state.active[s]))
    return dataclasses.replace(state, active=active), status


# ----------------------------------------------------------------------------- growing


@jax.jit
def grow_batch(state: PageAllocatorState, num_new_S):
    """Reserves `num_new_S[s]` more tokens in every slot s, taking pages when a sequence crosses
    a page boundary; all slots or none (status NO_PAGES if the pool is short) -> (state, status).
    """
    n = num_new_S.astype(jnp.int32)
    z, m = state.page_size, state.max_pages_per_seq
    new_len = state.lengths + jnp.where(state.active, n, 0)
    old_np, new_np = _cdiv(state.lengths, z), _cdiv(new_len, z)
    need = new_np - old_np
    status = _status((jnp.any((n != 0) & ~state.active), BAD_SLOT),
                     (jnp.any(n < 0), BAD_POSITION),
                     (jnp.any(new_np > m), TOO_LONG),
                     (jnp.sum(need) > state.num_free, NO_PAGES))
    # Slot s takes free pages [rank_s, rank_s + need_s) of the free list, in slot order.
    rank = jnp.cumsum(need) - need
    j = jnp.arange(m)[None, :]
    fresh = (j >= old_np[:, None]) & (j < new_np[:, None])
    free_ids = _free_pages(state.refcounts, state.num_pages)
    page = free_ids[jnp.clip(rank[:, None] + j - old_np[:, None], 0, state.num_pages - 1)]
    new = dataclasses.replace(
        state,
        refcounts=state.refcounts.at[jnp.where(fresh, page, state.num_pages)].add(1, mode="drop"),
        block_tables=jnp.where(fresh, page, state.block_tables),
        lengths=new_len)
    return _commit(status, new, state), status


@jax.jit
def grow(state: PageAllocatorState, slot, num_tokens):
    """Reserves `num_tokens` more tokens for one sequence -> (state, status)."""
    bad = _bad_slot(state, slot)
    s = jnp.clip(slot, 0, state.max_seqs - 1)
    n_S = jnp.zeros((state.max_seqs,), jnp.int32).at[s].set(jnp.asarray(num_tokens, jnp.int32))
    grown, status = grow_batch(state, n_S)
    status = jnp.where(bad, jnp.int32(BAD_SLOT), status)
    return _commit(status, grown, state), status


# ----------------------------------------------------------------------------- writing


def _copy_pages(pool, src_N, dst_N):
    """pool[..., dst] = pool[..., src]; dst == P is a no-op."""
    return pool.at[..., dst_N, :, :].set(pool[..., src_N, :, :], mode="drop")


@jax.jit
def copy_on_write(state: PageAllocatorState, pools, slots_N, positions_N):
    """Makes every page that tokens (slots_N[i], positions_N[i]) fall in private to its slot.

    A shared page (refcount > 1) is copied, in every pool of the pytree `pools`, to a fresh
    page that replaces it in that slot's block table; the old page loses one owner. Entries with
    slot < 0 are padding. Positions must be reserved (< length) -> (state, pools, status).
    """
    z, m, p = state.page_size, state.max_pages_per_seq, state.num_pages
    count = slots_N.shape[0]
    valid = slots_N >= 0
    s = jnp.clip(slots_N, 0, state.max_seqs - 1)
    pidx = jnp.clip(positions_N // z, 0, m - 1)
    bad_slot = jnp.any(valid & ((slots_N >= state.max_seqs) | ~state.active[s]))
    bad_pos = jnp.any(valid & ((positions_N < 0) | (positions_N >= state.lengths[s])))
    page = state.block_tables[s, pidx]
    # One copy per distinct (slot, page index), however many tokens land in it.
    key = jnp.where(valid, s * m + pidx, -1 - jnp.arange(count))
    first = jnp.argmax(key[:, None] == key[None, :], axis=1) == jnp.arange(count)
    need = valid & first & (state.refcounts[jnp.clip(page, 0, p - 1)] > 1)
    status = _status((bad_slot, BAD_SLOT), (bad_pos, BAD_POSITION),
                     (jnp.sum(need) > state.num_free, NO_PAGES))
    need = need & (status == OK)  # on failure: no copy, no table change
    rank = jnp.cumsum(need) - need
    fresh = jnp.where(need, _free_pages(state.refcounts, count)[jnp.clip(rank, 0, count - 1)], p)
    refcounts = state.refcounts.at[jnp.where(need, page, p)].add(-1, mode="drop")
    new = dataclasses.replace(
        state,
        refcounts=refcounts.at[fresh].set(1, mode="drop"),
        block_tables=state.block_tables.at[jnp.where(need, s, state.max_seqs), pidx].set(fresh, mode="drop"))
    pools = jax.tree.map(lambda x: _copy_pages(x, jnp.clip(page, 0, p - 1), fresh), pools)
    return new, pools, status


def scatter_tokens(pool, block_tables, slots_N, positions_N, x_NH):
    """Writes token rows x_NH [N, ..., H] into pool [..., P, Z, H] at (page, offset) of
    (slots_N[i], positions_N[i]); slot < 0 is padding. The pages must be private
    (`copy_on_write`) and reserved (`grow`): this only scatters.
    """
    num_pages, page_size = pool.shape[-3], pool.shape[-2]
    valid = slots_N >= 0
    s = jnp.clip(slots_N, 0, block_tables.shape[0] - 1)
    page = block_tables[s, jnp.clip(positions_N // page_size, 0, block_tables.shape[1] - 1)]
    page = jnp.where(valid & (page >= 0), page, num_pages)
    return pool.at[..., page, positions_N % page_size, :].set(
        jnp.moveaxis(x_NH.astype(pool.dtype), 0, -2), mode="drop")


@jax.jit
def write(state: PageAllocatorState, k_pages, v_pages, slots_N, positions_N, k_NH, v_NH):
    """Copy-on-write then scatter of N tokens' K and V -> (state, k_pages, v_pages, status).

    k_pages, v_pages [..., P, Z, H]; k_NH, v_NH [N, ..., H]. Tokens go to reserved positions
    (< length, see `grow`); slot < 0 marks padding. On a bad status nothing is written.
    """
    state, (k_pages, v_pages), status = copy_on_write(state, (k_pages, v_pages), slots_N, positions_N)
    slots_N = jnp.where(status == OK, slots_N, -1)
    k_pages = scatter_tokens(k_pages, state.block_tables, slots_N, positions_N, k_NH)
    v_pages = scatter_tokens(v_pages, state.block_tables, slots_N, positions_N, v_NH)
    return state, k_pages, v_pages, status


# ----------------------------------------------------------------------------- host side


def raise_for_status(status, state: PageAllocatorState, what: str = "page allocator") -> None:
    """Raises the error a non-OK status stands for (host side: reads the status)."""
    code = int(np.asarray(jax.device_get(status)))
    if code == OK:
        return
    if code == NO_PAGES:
        raise PagePoolExhausted(
            f"{what}: page pool exhausted: num_pages={state.num_pages} (page_size="
            f"{state.page_size}) has {int(state.num_free)} free pages, too few for this request; "
            "raise num_pages, free finished sequences, or preempt one")
    if code == NO_SLOTS:
        raise ValueError(f"{what}: all max_seqs={state.max_seqs} sequence slots are in use; "
                         "raise max_seqs or free a finished sequence")
    if code == BAD_SLOT:
        raise ValueError(f"{what}: slot is out of range [0, {state.max_seqs}) or holds no sequence; "
                         "pass a slot returned by allocate_slot or fork")
    if code == TOO_LONG:
        raise ValueError(f"{what}: a sequence would exceed max_pages_per_seq="
                         f"{state.max_pages_per_seq} pages of {state.page_size} tokens; "
                         "raise max_pages_per_seq or stop the sequence earlier")
    if code == BAD_POSITION:
        raise ValueError(f"{what}: a position or length is outside [0, length) of its sequence; "
                         "grow the sequence before writing, and truncate only to a shorter length")
    raise ValueError(f"{what}: unknown status {code}")


def checked(op):
    """Host wrapper of an operation: raises on a non-OK status and drops it from the result."""

    @functools.wraps(op)
    def run(state, *args, **kwargs):
        *out, status = op(state, *args, **kwargs)
        raise_for_status(status, state, op.__name__)
        return out[0] if len(out) == 1 else tuple(out)

    return run
