"""Page allocator: 10,000 random jitted operations against a pure-Python model, plus the
error paths. The model tracks pages as shared objects, so it predicts every status (including
pool exhaustion) and the exact sharing structure; pool contents are checked through the block
tables after every operation, so a stale page reaching a new owner fails the test."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.inference import page_allocator as pa

P, Z, S, M, NMAX, KH, HD = 16, 4, 5, 6, 8, 2, 2  # pages, page size, slots, pages/seq, write width


def _token(val):
    """K row of a token with sentinel `val`: distinct per head and dim, so placement is checked."""
    return val + 0.25 * np.arange(KH)[:, None] + 0.125 * np.arange(HD)[None, :]


class Model:
    """Reference allocator: slot -> [page objects], length, {position: sentinel}."""

    def __init__(self):
        self.slots = {}
        self.ids = itertools.count()

    def owners(self):
        count = {}
        for seq in self.slots.values():
            for obj in seq["pages"]:
                count[obj] = count.get(obj, 0) + 1
        return count

    def free(self):
        return P - len(self.owners())

    def lowest_free_slot(self):
        return min(set(range(S)) - set(self.slots)) if len(self.slots) < S else None

    def grow_status(self, need_by_slot):
        if any(s not in self.slots for s in need_by_slot):
            return pa.BAD_SLOT
        if any(-(-(self.slots[s]["length"] + n) // Z) > M for s, n in need_by_slot.items()):
            return pa.TOO_LONG
        need = sum(-(-(self.slots[s]["length"] + n) // Z) - len(self.slots[s]["pages"])
                   for s, n in need_by_slot.items())
        return pa.NO_PAGES if need > self.free() else pa.OK

    def grow(self, need_by_slot):
        for s, n in need_by_slot.items():
            seq = self.slots[s]
            seq["length"] += n
            while len(seq["pages"]) < -(-seq["length"] // Z):
                seq["pages"].append(next(self.ids))

    def write_status(self, tokens):
        if any(s not in self.slots for s, _ in tokens):
            return pa.BAD_SLOT
        if any(not 0 <= pos < self.slots[s]["length"] for s, pos in tokens):
            return pa.BAD_POSITION
        owners = self.owners()
        touched = {(s, pos // Z) for s, pos in tokens}
        need = sum(owners[self.slots[s]["pages"][j]] > 1 for s, j in touched)
        return pa.NO_PAGES if need > self.free() else pa.OK

    def write(self, tokens, vals):
        owners = self.owners()
        cows = 0
        for s, j in {(s, pos // Z) for s, pos in tokens}:
            if owners[self.slots[s]["pages"][j]] > 1:
                self.slots[s]["pages"][j] = next(self.ids)
                cows += 1
        for (s, pos), val in zip(tokens, vals, strict=True):
            self.slots[s]["values"][pos] = val
        return cows

    def truncate(self, s, length):
        seq = self.slots[s]
        seq["length"] = length
        seq["pages"] = seq["pages"][: -(-length // Z)]
        seq["values"] = {p: v for p, v in seq["values"].items() if p < length}


def _check(state, k_pages, v_pages, model):
    refc, bt, lengths, active = (np.asarray(x) for x in jax.device_get(
        (state.refcounts, state.block_tables, state.lengths, state.active)))
    k, v = np.asarray(k_pages), np.asarray(v_pages)
    assert sorted(np.flatnonzero(active)) == sorted(model.slots)
    obj_to_page, counts, reads = {}, np.zeros(P, np.int64), []
    for s in range(S):
        if s not in model.slots:
            assert (bt[s] == pa.NO_PAGE).all() and lengths[s] == 0
            continue
        seq = model.slots[s]
        n = len(seq["pages"])
        assert lengths[s] == seq["length"] and n == -(-seq["length"] // Z)
        assert (bt[s, :n] >= 0).all() and (bt[s, n:] == pa.NO_PAGE).all()
        for obj, page in zip(seq["pages"], bt[s, :n], strict=True):
            assert obj_to_page.setdefault(obj, page) == page, "one model page on two real pages"
            counts[page] += 1
        reads += [(bt[s, pos // Z], pos % Z, seq["values"][pos]) for pos in range(seq["length"])]
    assert len(set(obj_to_page.values())) == len(obj_to_page), "two model pages on one real page"
    if reads:  # reads through the block tables below each length see only the owner's writes
        page, off, val = (np.array(x) for x in zip(*reads, strict=True))
        want = val[None, :, None] + 0.25 * np.arange(KH)[:, None, None] + 0.125 * np.arange(HD)
        np.testing.assert_array_equal(k[:, page, off], want)
        np.testing.assert_array_equal(v[:, page, off], -want)
    np.testing.assert_array_equal(refc, counts)  # no page lost, shared iff refcount matches owners


def test_random_operations_match_model():
    rng = np.random.default_rng(0)
    model = Model()
    state = pa.init_allocator(P, Z, S, M)
    k_pages = jnp.full((KH, P, Z, HD), jnp.nan, jnp.float32)  # never-written memory reads as NaN
    v_pages = k_pages
    vals = itertools.count(1)
    seen, cows = {code: 0 for code in range(6)}, 0

    def do_write(tokens):
        nonlocal k_pages, v_pages, state, cows
        expect = model.write_status(tokens)
        sentinels = [float(next(vals)) for _ in tokens]
        pad = NMAX - len(tokens)
        slots = np.array([s for s, _ in tokens] + [-1] * pad, np.int32)
        pos = np.array([p for _, p in tokens] + [0] * pad, np.int32)
        k_new = np.stack([_token(x) for x in sentinels] + [np.zeros((KH, HD))] * pad).astype(np.float32)
        state, k_pages, v_pages, status = pa.write(state, k_pages, v_pages, slots, pos, k_new, -k_new)
        assert int(status) == expect
        if expect == pa.OK:
            cows += model.write(tokens, sentinels)
        return expect

    for _ in range(10_000):
        op = rng.choice(["alloc", "grow", "step", "write", "fork", "truncate", "free"],
                        p=[0.14, 0.3, 0.1, 0.16, 0.1, 0.08, 0.12])
        slot = int(rng.integers(S))
        if op == "alloc":
            expect = pa.NO_SLOTS if model.lowest_free_slot() is None else pa.OK
            state, got, status = pa.allocate_slot(state)
            if expect == pa.OK:
                assert int(got) == model.lowest_free_slot()
                model.slots[int(got)] = dict(pages=[], length=0, values={})
        elif op in ("grow", "step"):
            if op == "grow":  # one sequence gets a prompt chunk
                need = {slot: int(rng.integers(NMAX + 1))}
                state, status = pa.grow(state, slot, need[slot])
            else:  # a decode step: every live sequence gets one token
                need = {s: 1 for s in model.slots}
                n_S = np.zeros(S, np.int32)
                n_S[list(need)] = 1
                state, status = pa.grow_batch(state, n_S)
            expect = model.grow_status(need)
            if expect == pa.OK:
                old = {s: model.slots[s]["length"] for s in need}
                model.grow(need)
                tokens = [(s, p) for s, n in need.items() for p in range(old[s], old[s] + n)]
                if tokens and do_write(tokens) != pa.OK:  # could not make a page private: roll back
                    for s, length in old.items():
                        state, st = pa.truncate(state, s, length)
                        assert int(st) == pa.OK
                        model.truncate(s, length)
        elif op == "write":
            length = model.slots[slot]["length"] if slot in model.slots else 0
            n = int(rng.integers(1, min(NMAX, max(length, 1)) + 1))
            pos = rng.choice(max(length, 1) + 1, size=min(n, max(length, 1) + 1), replace=False)
            if rng.random() > 0.05:  # mostly valid positions, sometimes one past the end
                pos = pos[pos < length]
            expect = do_write([(slot, int(p)) for p in pos]) if len(pos) else None
            status = expect
        elif op == "fork":
            dst = model.lowest_free_slot()
            expect = pa.BAD_SLOT if slot not in model.slots else pa.NO_SLOTS if dst is None else pa.OK
            state, got, status = pa.fork(state, slot)
            if expect == pa.OK:
                assert int(got) == dst
                src = model.slots[slot]
                model.slots[dst] = dict(pages=list(src["pages"]), length=src["length"],
                                        values=dict(src["values"]))
        elif op == "truncate":
            length = model.slots[slot]["length"] if slot in model.slots else 0
            new = int(rng.integers(length + 2))
            expect = (pa.BAD_SLOT if slot not in model.slots
                      else pa.BAD_POSITION if new > length else pa.OK)
            state, status = pa.truncate(state, slot, new)
            if expect == pa.OK:
                model.truncate(slot, new)
        else:
            expect = pa.BAD_SLOT if slot not in model.slots else pa.OK
            state, status = pa.free(state, slot)
            if expect == pa.OK:
                del model.slots[slot]
        if status is not None:
            assert int(status) == expect, (op, int(status), expect)
            seen[expect] += 1
        _check(state, k_pages, v_pages, model)
    # The stream reached every outcome, so the checks above were exercised on each path.
    assert all(seen[c] > 20 for c in range(6)), seen
    assert cows > 50, cows


def test_exhausted_pool_raises_and_changes_nothing():
    state = pa.checked(pa.grow)(pa.checked(pa.allocate_slot)(pa.init_allocator(4, 8, 2, 8))[0], 0, 30)
    before = jax.device_get(state)
    after, status = pa.grow(state, 0, 8)  # 38 tokens need 5 pages of 8; the pool has 4
    assert int(status) == pa.NO_PAGES
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(after), before)
    with pytest.raises(pa.PagePoolExhausted, match="num_pages=4"):
        pa.checked(pa.grow)(state, 0, 8)


def test_checked_errors_name_the_field():
    state = pa.init_allocator(4, 8, 1, 2)
    with pytest.raises(ValueError, match="slot"):
        pa.checked(pa.free)(state, 0)
    state, _ = pa.checked(pa.allocate_slot)(state)
    with pytest.raises(ValueError, match="max_seqs=1"):
        pa.checked(pa.fork)(state, 0)
    with pytest.raises(ValueError, match="max_pages_per_seq=2"):
        pa.checked(pa.grow)(state, 0, 17)
    with pytest.raises(ValueError, match="num_pages"):
        pa.init_allocator(0, 8, 1, 1)


def test_layered_pools_copy_on_write_and_scatter():
    """Pools with leading axes ([L, K, P, Z, H], a model's cache) copy and scatter per page."""
    layers, z = 3, 4
    state = pa.init_allocator(num_pages=6, page_size=z, max_seqs=2, max_pages_per_seq=3)
    state, a = pa.checked(pa.allocate_slot)(state)
    state = pa.checked(pa.grow)(state, a, 6)
    pools = {"k": jnp.zeros((layers, KH, 6, z, HD)), "v": jnp.zeros((layers, KH, 6, z, HD))}
    x = jnp.arange(6 * layers * KH * HD, dtype=jnp.float32).reshape(6, layers, KH, HD) + 1
    slots, pos = jnp.full((6,), a), jnp.arange(6, dtype=jnp.int32)
    pools = {n: pa.scatter_tokens(p, state.block_tables, slots, pos, x) for n, p in pools.items()}
    state, b = pa.checked(pa.fork)(state, a)
    state, pools = pa.checked(pa.copy_on_write)(state, pools, jnp.array([b, b]), jnp.array([5, 4]))
    bt = np.asarray(state.block_tables)
    assert bt[a, 0] == bt[b, 0] and bt[a, 1] != bt[b, 1]  # only the written page was copied
    np.testing.assert_array_equal(np.asarray(state.refcounts)[[bt[a, 0], bt[a, 1], bt[b, 1]]], [2, 1, 1])
    for p in pools.values():
        for s in (a, b):  # both owners read the same tokens through their own tables
            got = np.stack([np.asarray(p)[:, :, bt[s, t // z], t % z] for t in range(6)])
            np.testing.assert_array_equal(got, np.asarray(x))
