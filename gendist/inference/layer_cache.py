"""The decode fast path's KV cache: max_len slots per sequence, one K and one V buffer per layer.

`ContiguousKVCache` stacks every layer's keys in one [L, B, S, K, H] array, which a layer
scan slices and re-stacks; inside a decode loop XLA then rewrites the whole stack every
step (a concatenate of the L updated slices: read and write of every cached byte, seen in
the compiled HLO). Here each layer has its own buffers, threaded through the loop as
separate values, so a step's write is an in-place update of one row per sequence and
layer. The decode block runs its layers straight-line over them (`decode_block.run_layers`);
a scanned model still works (`layer_state` stacks, at the cost of a copy).

Positions must lie in [0, max_len): a write is a plain in-place row update (scatter mode
"clip"; "drop" would read and select the old row first, one more kernel per buffer and
layer). Every caller sizes the cache for the whole generation (`generate_tokens`:
prompt + new tokens; speculative decoding: + γ + 1).

Backends:
* "xla": buffers [B, S, K, H]; attention in jnp over all S slots (masked), the same math as
  `ContiguousKVCache` (`cache.contiguous_attention`).
* "pallas": buffers [K, B, S, H], which are a page pool [K, B·S/Z, Z, H] in which sequence
  b owns pages b·S/Z ... (b+1)·S/Z − 1. Decode attention is the paged kernel
  (`pallas_kernels.paged_attention`: Mosaic GPU on Hopper, Triton elsewhere), which reads
  only the pages below each sequence's length instead of all max_len slots; several query
  tokens (prefill, speculative verification) go through `paged_attention_chunk`. With
  `fused` (the default), a one-token step instead goes through
  `pallas_kernels.decode_attention` from the unsplit q|k|v projection: RoPE, both row writes
  and attention in one kernel (`decode_kernels`, `attend_qkv`), and the model's norms run as
  one kernel each (`pallas_kernels.rms_norm`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gendist.inference.cache import KVCache, contiguous_attention
from pallas_kernels import decode_attention
from pallas_kernels.paged_attention import paged_attention, paged_attention_chunk

BACKENDS = ("xla", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKVCache(KVCache):
    k: tuple  # L arrays: [B, S, K, H] ("xla") or [K, B, S, H] ("pallas")
    v: tuple
    lengths: jax.Array  # [B] int32
    backend: str = dataclasses.field(default="xla", metadata=dict(static=True))
    page_size: int = dataclasses.field(default=64, metadata=dict(static=True))
    # "pallas" only: decode steps of one token through the fused kernels (`decode_kernels`).
    fused: bool = dataclasses.field(default=True, metadata=dict(static=True))
    # The fused attention kernel's tiling as a tag ("bk128_sp1_w4_st3"; "": its defaults).
    tiling: str = dataclasses.field(default="", metadata=dict(static=True))

    @classmethod
    def create(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32, *,
               backend="xla", page_size=64, fused=True, tiling=""):
        """Empty buffers for `batch` sequences of up to `max_len` tokens (rounded up to whole
        pages of `page_size` tokens for the "pallas" backend)."""
        if backend not in BACKENDS:
            raise ValueError(f"LayerKVCache backend={backend!r}; choose one of {BACKENDS}.")
        if backend == "pallas":
            if page_size < 8 or page_size & (page_size - 1):
                raise ValueError(f"LayerKVCache page_size={page_size} must be a power of two "
                                 ">= 8 (the paged kernels' tiles).")
            slots = -(-max_len // page_size) * page_size
            shape = (num_kv_heads, batch, slots, head_dim)
        else:
            shape = (batch, max_len, num_kv_heads, head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        zeros_v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        decode_attention.parse_tiling(tiling)  # a bad tag fails here, not inside a trace
        return cls(zeros, zeros_v, jnp.zeros((batch,), jnp.int32), backend, page_size, fused,
                   tiling)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2 if self.backend == "pallas" else 1]

    def layer_states(self):
        return list(zip(self.k, self.v, strict=True))

    def with_layer_states(self, states):
        return dataclasses.replace(self, k=tuple(s[0] for s in states),
                                   v=tuple(s[1] for s in states))

    def layer_state(self):  # for a scanned (stacked-weights) model: a stacked copy
        return (jnp.stack(self.k), jnp.stack(self.v))

    def with_layer_state(self, state):
        k, v = state
        return dataclasses.replace(self, k=tuple(k), v=tuple(v))

    def decode_kernels(self, batch: int, tokens: int) -> tuple[bool, bool]:
        """On the "pallas" backend with `fused`: RMSNorm as one kernel for up to 64 rows of a
        power-of-two width, and for one new token per sequence RoPE + write + attention as
        one kernel (`pallas_kernels.decode_attention`: one program per sequence and KV head,
        no context split), where that grid suits the cache: up to 4,096 slots, or enough
        sequences x KV heads (>= 132, an H200's SMs) to fill the GPU. The paged kernels,
        which split long contexts, serve the rest."""
        if self.backend != "pallas" or not self.fused:
            return False, False
        K, B, S, H = self.k[0].shape
        attention = (tokens == 1 and decode_attention.supports(H)
                     and (S <= 4096 or B * K >= 132))
        return batch * tokens <= 64, attention

    def attend_qkv(self, layer_state, qkv_BTCH, num_heads, q_pos_BT, cos_BTh, sin_BTh,
                   sm_scale):
        k_buf, v_buf = layer_state
        o_BNH, k_buf, v_buf = decode_attention.decode_attention(
            qkv_BTCH[:, 0], k_buf, v_buf, q_pos_BT[:, 0], cos_BTh[:, 0], sin_BTh[:, 0],
            num_heads=num_heads, sm_scale=sm_scale, **decode_attention.parse_tiling(self.tiling))
        return o_BNH[:, None], (k_buf, v_buf)

    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        k_buf, v_buf = layer_state
        if self.backend == "xla":  # [B, S, K, H]: token rows on axes (0, 1)
            k_buf = write_rows(k_buf, k_BTKH, q_pos_BT, 0)
            v_buf = write_rows(v_buf, v_BTKH, q_pos_BT, 0)
            out = contiguous_attention(k_buf, v_buf, q_BTNH, q_pos_BT, sm_scale)
            return out, (k_buf, v_buf)
        # [K, B, S, H]: token rows on axes (1, 2), heads first.
        k_buf = write_rows(k_buf, jnp.moveaxis(k_BTKH, 2, 0), q_pos_BT, 1)
        v_buf = write_rows(v_buf, jnp.moveaxis(v_BTKH, 2, 0), q_pos_BT, 1)
        K, B, S, H = k_buf.shape
        T = q_pos_BT.shape[1]
        z = self.page_size
        pages = S // z
        k_KPZH = k_buf.reshape(K, B * pages, z, H)  # the same bytes seen as a page pool
        v_KPZH = v_buf.reshape(K, B * pages, z, H)
        tables_BP = (jnp.arange(B, dtype=jnp.int32)[:, None] * pages
                     + jnp.arange(pages, dtype=jnp.int32)[None, :])
        kv_len_B = (jnp.max(q_pos_BT, axis=1) + 1).astype(jnp.int32)
        q = q_BTNH.astype(k_buf.dtype)
        if T == 1:
            out = paged_attention(q[:, 0], k_KPZH, v_KPZH, tables_BP, kv_len_B,
                                  sm_scale=sm_scale)[:, None]
        else:
            out = paged_attention_chunk(q, k_KPZH, v_KPZH, tables_BP, kv_len_B,
                                        q_pos_BT.astype(jnp.int32), sm_scale=sm_scale)
        return out.astype(q_BTNH.dtype), (k_buf, v_buf)


def write_rows(buf, rows, pos_BT, axis: int):
    """buf with rows[..., b, t, ...] written at (b, pos_BT[b, t]) on axes (axis, axis + 1):
    rows has buf's shape with T in place of the slot axis. Positions must be in range and
    consecutive within a sequence (pos_BT[b, t] = pos_BT[b, 0] + t), as every decoding
    caller's are: a prefill, a decode step, a speculative verification of γ + 1 tokens.

    One sequence (batch-1 decoding and verification) is a dynamic-update-slice: an in-place
    write of its T rows alone (on an H200 a scatter of 5 rows cost 2.4 µs against 1.1 µs
    for the slice, twice per layer: `benchmarks/profile_decode_*_g4.json`). Otherwise a
    scatter; its "clip" mode makes XLA skip the out-of-range handling of "drop" (which
    reads and selects the old row), but XLA still checks the clamped index.
    """
    B, T = pos_BT.shape
    rows = rows.astype(buf.dtype)
    if B == 1:
        start = [jnp.int32(0)] * buf.ndim
        start[axis + 1] = pos_BT[0, 0].astype(jnp.int32)
        return jax.lax.dynamic_update_slice(buf, rows, start)
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    index = (slice(None),) * axis + (b_BT, pos_BT)
    return buf.at[index].set(rows, mode="clip")
