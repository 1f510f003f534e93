"""The KV-cache interface the model decodes through, and its contiguous implementation.

A cache is a pytree with two parts: per-layer arrays stacked on a leading `layers` axis
(scanned together with the layer weights) and shared bookkeeping (lengths, block tables).
The transformer calls, inside its layer scan, `cache.attend(layer_state, q, k, v, q_pos)`,
which writes the new K/V and attends over everything cached for that sequence. A paged
cache implements the same three methods.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from gendist.models.attention import xla_attention
from gendist.models.layers import apply_rope


class KVCache(abc.ABC):
    """What the transformer needs from a cache."""

    lengths: jax.Array  # [B] int32: tokens already cached per sequence

    @abc.abstractmethod
    def layer_state(self):
        """Per-layer arrays, each with a leading `layers` axis (scanned by the model)."""

    @abc.abstractmethod
    def with_layer_state(self, state) -> KVCache:
        """This cache with new per-layer arrays."""

    @abc.abstractmethod
    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        """Write k, v at positions q_pos and attend; returns (out_BTNH, new_layer_state)."""

    def layer_states(self) -> list:
        """The per-layer arrays as a list, one entry per layer, for a model whose layers are
        separate buffers (`decode_block.run_layers`). Caches that keep one buffer per layer
        return them as they are; the default slices the stacked arrays."""
        state = self.layer_state()
        num = jax.tree.leaves(state)[0].shape[0]
        return [jax.tree.map(lambda a, i=i: a[i], state) for i in range(num)]

    def with_layer_states(self, states: list) -> KVCache:
        """This cache with new per-layer arrays given as a list (see `layer_states`)."""
        return self.with_layer_state(jax.tree.map(lambda *a: jnp.stack(a), *states))

    def decode_kernels(self, batch: int, tokens: int) -> tuple[bool, bool]:
        """(norm, attention): whether the decode block (`decode_block`) runs a step of
        `tokens` new tokens for `batch` sequences through the fused decode kernels: RMSNorm
        as one kernel, and RoPE + cache write + attention as one (`attend_qkv`). Off here;
        `LayerKVCache` turns them on for its GPU backend."""
        return False, False

    def attend_qkv(self, layer_state, qkv_BTCH, num_heads: int, q_pos_BT, cos_BTh, sin_BTh,
                   sm_scale):
        """`attend` from the fused q|k|v projection [B, T, N+2K, H] before RoPE (angles
        cos/sin [B, T, H/2]). Here: split, rotate, `attend`, the model's own steps;
        `LayerKVCache` does it in one kernel (the decode block calls this only when
        `decode_kernels` says attention is fused)."""
        kv_heads = (qkv_BTCH.shape[2] - num_heads) // 2
        q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTCH, [num_heads, num_heads + kv_heads], axis=2)
        return self.attend(layer_state, apply_rope(q_BTNH, cos_BTh, sin_BTh),
                           apply_rope(k_BTKH, cos_BTh, sin_BTh), v_BTKH, q_pos_BT, sm_scale)

    def prepare(self, q_pos_BT: jax.Array) -> KVCache:
        """Called once per forward before the layer scan (a paged cache reserves pages)."""
        return self

    def advance(self, num_new_B: jax.Array) -> KVCache:
        """Count `num_new_B` more tokens as cached (per sequence: they may differ)."""
        return dataclasses.replace(self, lengths=self.lengths + num_new_B.astype(jnp.int32))

    def rollback(self, lengths_B: jax.Array) -> KVCache:
        """Forget everything past `lengths_B` (speculative decoding rejects drafts).

        Required by speculative decoding, which carries the cache through
        `lax.while_loop`: the cache must be a pytree of fixed shapes, and rolling back must
        not change them (only `lengths`, and what attention reads, moves)."""
        return dataclasses.replace(self, lengths=lengths_B.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousKVCache(KVCache):
    """max_len slots reserved per sequence: k, v [L, B, S, K, H]."""

    k_LBSKH: jax.Array
    v_LBSKH: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32):
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k_LBSKH.shape[2]

    def layer_state(self):
        return (self.k_LBSKH, self.v_LBSKH)

    def with_layer_state(self, state):
        k, v = state
        return dataclasses.replace(self, k_LBSKH=k, v_LBSKH=v)

    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        return contiguous_attend(layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale)


def contiguous_attend(layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
    """Write k, v into one layer's [B, S, K, H] buffers at q_pos, then attend over them."""
    k_BSKH, v_BSKH = layer_state
    # Rows are written at each sequence's own positions; positions past max_len are
    # dropped by the scatter (callers check lengths against max_len on the host).
    b_BT = jnp.broadcast_to(jnp.arange(q_BTNH.shape[0])[:, None], q_pos_BT.shape)
    k_BSKH = k_BSKH.at[b_BT, q_pos_BT].set(k_BTKH.astype(k_BSKH.dtype), mode="drop")
    v_BSKH = v_BSKH.at[b_BT, q_pos_BT].set(v_BTKH.astype(v_BSKH.dtype), mode="drop")
    return contiguous_attention(k_BSKH, v_BSKH, q_BTNH, q_pos_BT, sm_scale), (k_BSKH, v_BSKH)


def contiguous_attention(k_BSKH, v_BSKH, q_BTNH, q_pos_BT, sm_scale):
    """Attention of q (at positions q_pos) over [B, S, K, H] buffers already written."""
    kv_len_B = jnp.max(q_pos_BT, axis=1) + 1
    return xla_attention(q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype),
                         q_pos_BT, kv_len_B, sm_scale)
