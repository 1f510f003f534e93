"""The paged KV cache behind the model's cache interface (PagedAttention, Kwon et al. 2023).

One pool of pages per layer, [L, K, P, Z, H]; batch row b is allocator slot b, whose block
table maps its logical pages to physical ones. Before a forward, `prepare` reserves pages
for the positions about to be written (on demand, shared pages copied on write); each
layer scatters its new K/V into the pages and attends through the block table with the
Pallas paged-attention kernel (`backend="pallas"`) or a gather-based jnp path ("xla").
`rollback` returns pages past the new length to the free list, so speculative decoding's
rejected tokens cost no memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gendist.inference import page_allocator as pa
from gendist.inference.cache import KVCache
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_chunk,
    paged_attention_chunk_reference,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(KVCache):
    k_LKPZH: jax.Array  # [L, K, P, Z, H], or a tuple of L pools [K, P, Z, H] (per_layer)
    v_LKPZH: jax.Array
    alloc: pa.PageAllocatorState
    lengths: jax.Array  # [B] tokens committed per slot (alloc.lengths may reserve more)
    status: jax.Array  # [] int32 allocator status of the last prepare (pa.OK or an error)
    backend: str = dataclasses.field(default="xla", metadata=dict(static=True))
    # Pages may be shared (`page_allocator.fork`): a write first copies a shared page. False
    # when nothing forks (the engine): `prepare` then skips copy-on-write, whose gather and
    # scatter of the written pages read every page pool in full on every call.
    share_pages: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @classmethod
    def create(cls, num_layers, batch, max_len, num_kv_heads, head_dim, *, num_pages,
               page_size=16, dtype=jnp.float32, backend="xla", active=True, per_layer=False,
               share_pages=True):
        """A pool of `num_pages` pages per layer shared by `batch` slots of up to max_len.

        per_layer: one pool buffer per layer (tuples of L arrays [K, P, Z, H]) instead of one
        stacked [L, K, P, Z, H] array, for a model in the decode layout
        (the fast path, `decode_block`), which then writes each layer's pool in place.
        """
        pages_per_seq = -(-max_len // page_size)
        alloc = pa.init_allocator(num_pages, page_size, batch, pages_per_seq)
        if active:
            alloc = dataclasses.replace(alloc, active=jnp.ones((batch,), bool))
        if per_layer:
            shape = (num_kv_heads, num_pages, page_size, head_dim)
            k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        else:
            shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
            k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
        return cls(k, v, alloc, jnp.zeros((batch,), jnp.int32), jnp.int32(pa.OK), backend,
                   share_pages)

    @property
    def page_size(self) -> int:
        return self.alloc.page_size

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k_LKPZH, tuple)

    def layer_state(self):
        if self.per_layer:  # a scanned model over per-layer pools: a stacked copy
            return (jnp.stack(self.k_LKPZH), jnp.stack(self.v_LKPZH))
        return (self.k_LKPZH, self.v_LKPZH)

    def with_layer_state(self, state):
        k, v = state
        if self.per_layer:
            k, v = tuple(k), tuple(v)
        return dataclasses.replace(self, k_LKPZH=k, v_LKPZH=v)

    def layer_states(self):
        if self.per_layer:
            return list(zip(self.k_LKPZH, self.v_LKPZH, strict=True))
        return super().layer_states()

    def with_layer_states(self, states):
        if self.per_layer:
            return dataclasses.replace(self, k_LKPZH=tuple(s[0] for s in states),
                                       v_LKPZH=tuple(s[1] for s in states))
        return super().with_layer_states(states)

    def prepare(self, q_pos_BT):
        """Reserve pages up to the largest position each slot writes; copy shared pages."""
        need_B = jnp.maximum(jnp.max(q_pos_BT, axis=1) + 1 - self.alloc.lengths, 0)
        need_B = jnp.where(self.alloc.active, need_B, 0)
        alloc, status = pa.grow_batch(self.alloc, need_B)
        if not self.share_pages:
            return dataclasses.replace(self, alloc=alloc, status=status)
        B, T = q_pos_BT.shape
        live = self.alloc.active[:, None] & (q_pos_BT >= 0) & (status == pa.OK)
        slots = jnp.where(live, jnp.arange(B)[:, None], -1).reshape(-1)
        alloc, (k, v), cow = pa.copy_on_write(alloc, (self.k_LKPZH, self.v_LKPZH), slots,
                                              jnp.maximum(q_pos_BT, 0).reshape(-1))
        status = jnp.where(status == pa.OK, cow, status)
        return dataclasses.replace(self, alloc=alloc, k_LKPZH=k, v_LKPZH=v, status=status)

    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        k_KPZH, v_KPZH = layer_state
        B, T = q_pos_BT.shape
        # Rows not taking part in this call carry position -1 and write nothing.
        ok = (self.status == pa.OK) & self.alloc.active[:, None] & (q_pos_BT >= 0)
        slots = jnp.where(ok, jnp.arange(B)[:, None], -1).reshape(-1)
        pos = jnp.maximum(q_pos_BT, 0).reshape(-1)
        # scatter_tokens takes rows [N, K, H] into pools [K, P, Z, H].
        k_KPZH = pa.scatter_tokens(k_KPZH, self.alloc.block_tables, slots, pos,
                                   k_BTKH.reshape(B * T, *k_BTKH.shape[2:]))
        v_KPZH = pa.scatter_tokens(v_KPZH, self.alloc.block_tables, slots, pos,
                                   v_BTKH.reshape(B * T, *v_BTKH.shape[2:]))
        kv_len_B = jnp.max(q_pos_BT, axis=1) + 1
        tables = jnp.maximum(self.alloc.block_tables, 0)
        kp, vp = k_KPZH.astype(q_BTNH.dtype), v_KPZH.astype(q_BTNH.dtype)
        if self.backend == "pallas" and T == 1:
            out = paged_attention(q_BTNH[:, 0], kp, vp, tables, kv_len_B,
                                  sm_scale=sm_scale)[:, None]
        elif self.backend == "pallas":
            out = paged_attention_chunk(q_BTNH, kp, vp, tables, kv_len_B, q_pos_BT,
                                        sm_scale=sm_scale)
        else:
            out = paged_attention_chunk_reference(q_BTNH, kp, vp, tables, kv_len_B, q_pos_BT,
                                                  sm_scale=sm_scale)
        return out.astype(q_BTNH.dtype), (k_KPZH, v_KPZH)

    def rollback(self, lengths_B):
        """Keep `lengths_B` tokens per slot; pages past them go back to the free list."""
        lengths_B = lengths_B.astype(jnp.int32)

        def body(s, alloc):
            keep = jnp.maximum(lengths_B[s], 0)
            new, st = pa.truncate(alloc, s, jnp.minimum(keep, alloc.lengths[s]))
            return jax.tree.map(lambda a, b: jnp.where(alloc.active[s], a, b), new, alloc)

        alloc = jax.lax.fori_loop(0, lengths_B.shape[0], body, self.alloc)
        return dataclasses.replace(self, alloc=alloc, lengths=lengths_B)

    def take_rows(self, rows_R, activate: bool = False):
        """A cache of R rows over the same page pools: row r is slot rows_R[r] (its block
        table, lengths, active flag); a row index >= the slot count is padding, an empty
        inactive row that writes nothing. `activate`: the real rows start active (a slot
        claimed for a new sequence). Run a forward on it, then `put_rows` it back, to
        compute only some slots (the engine's prefill of the requests that join)."""
        a = self.alloc

        def get(x, fill):
            return x.at[rows_R].get(mode="fill", fill_value=fill)

        active = (rows_R >= 0) & (rows_R < a.max_seqs) if activate else get(a.active, False)
        alloc = dataclasses.replace(a, block_tables=get(a.block_tables, pa.NO_PAGE),
                                    lengths=get(a.lengths, 0), active=active)
        return dataclasses.replace(self, alloc=alloc, lengths=get(self.lengths, 0))

    def put_rows(self, view, rows_R):
        """Slots rows_R take the rows of `view` (from `take_rows`; padding rows are dropped);
        the pools, page refcounts and status are the view's."""
        a, b = self.alloc, view.alloc

        def put(x, y):
            return x.at[rows_R].set(y, mode="drop")

        alloc = dataclasses.replace(a, refcounts=b.refcounts,
                                    block_tables=put(a.block_tables, b.block_tables),
                                    lengths=put(a.lengths, b.lengths), active=put(a.active, b.active))
        return dataclasses.replace(self, k_LKPZH=view.k_LKPZH, v_LKPZH=view.v_LKPZH, alloc=alloc,
                                   lengths=put(self.lengths, view.lengths), status=view.status)

    def free_slots(self, mask_B):
        """End the sequences of every active slot where mask_B is set (`free_slot` for many
        at once, in one pass: each of their pages loses one owner)."""
        a = self.alloc
        mask_B = mask_B & a.active
        held = mask_B[:, None] & (a.block_tables >= 0)
        refcounts = a.refcounts.at[jnp.where(held, a.block_tables, a.num_pages)].add(
            -1, mode="drop")
        alloc = dataclasses.replace(
            a, refcounts=refcounts,
            block_tables=jnp.where(mask_B[:, None], pa.NO_PAGE, a.block_tables),
            lengths=jnp.where(mask_B, 0, a.lengths), active=a.active & ~mask_B)
        return dataclasses.replace(self, alloc=alloc, lengths=jnp.where(mask_B, 0, self.lengths))

    def free_slot(self, slot):
        """End a sequence: its pages return to the pool (shared ones lose one owner)."""
        alloc, _ = pa.free(self.alloc, slot)
        return dataclasses.replace(self, alloc=alloc, lengths=self.lengths.at[slot].set(0))
