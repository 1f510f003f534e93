"""A prompt's attention over one sequence's cache in one kernel: RoPE, causal attention over
the cached rows and the prompt's own, and the prompt's rotated keys and values handed back.

Before the decode megakernel takes over, a prompt of T tokens runs through the decode block
in XLA, and there each layer's attention was a dozen kernels at batch 1: q rotated, k rotated
and scattered into the cache, v scattered, the cache moved into attention's layout and back,
scores, mask, maximum, exponent, sum, cast and P V (`benchmarks/decode.md`, "Before the
loop"). Here it is one launch a layer:

* q|k|v come as the decode layout's one projection [T, N+2K, H] (no slices materialised);
* q and the prompt's k are rotated in registers (NeoX pairs, angles as cos/sin [T, H/2]);
* each query row attends to the cached rows 0 … start-1 (read in place from the cache
  [L, 2, K, S, H] at the layer given, a runtime index: no copy, and one kernel serves every
  layer of a scan over them) and then to the
  prompt's rows up to its own (causal), taken from q|k|v, with an online softmax (base 2);
* the prompt's rotated k and its v come back as rows [2, K, T, H], which the caller writes
  into the cache once for every layer (`gendist.inference.megakernel.ChainCache`): the kernel
  never writes the cache it reads, so its programs need no order among them.

Grid (K, query tiles): one program a KV head and tile of `tile` tokens; its rows are the
tile's tokens times the G = N/K query heads of the group (padded to a power of two of at least
16 for the tensor core). Rounding follows the unfused math (`prompt_attention_reference`):
q and k rotated in fp32 and cast to the cache dtype, products accumulated in fp32, the
probabilities cast to the cache dtype before P V.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import (
    dot_f32,
    next_pow2,
    plgpu,
    precision_for,
    resolve_interpret,
    triton_params,
)

# the one-token kernel's RoPE, its finite -inf and log2(e), and the head dims it takes
from pallas_kernels.decode_attention import _LOG2E, _NEG, _rope, rope_reference, supports

ROWS = 64  # query rows a program at most (tile tokens x group heads), a power of two


def _kernel(where_ref, qkv_ref, cos_ref, sin_ref, kv_ref, o_ref, k_out, v_out, *, num_heads, kv_heads,
            tokens, tile, rows, block_k, scale_log2, precision):
    kh, qt = pl.program_id(0), pl.program_id(1)
    group = num_heads // kv_heads
    C = num_heads + 2 * kv_heads  # q|k|v's heads a token
    layers, _, _, capacity, H = kv_ref.shape
    h2 = H // 2
    dt = kv_ref.dtype
    f32 = jnp.float32
    start = jnp.clip(where_ref[0], 0, capacity)
    layer = jnp.clip(where_ref[1], 0, layers - 1)
    k_at, v_at = jnp.int32(0), jnp.int32(1)  # arrays, as the layer is: interpret mode's loads take no mix
    t0 = qt * tile
    d2 = jnp.arange(h2, dtype=jnp.int32)[None, :]
    dH = jnp.arange(H, dtype=jnp.int32)[None, :]

    def angles(t):  # cos, sin [n, H/2] of tokens t [n] (past the prompt: its last token's)
        t = jnp.minimum(t, tokens - 1)[:, None]
        return plgpu.load(cos_ref.at[t, d2]), plgpu.load(sin_ref.at[t, d2])

    def new_kv(u):  # the prompt's rotated k halves and v of tokens u [n] (0 past the prompt)
        m = (u < tokens)[:, None]
        k_row = (u * C + num_heads + kh)[:, None]
        c, s = angles(u)
        k1, k2 = _rope(plgpu.load(qkv_ref.at[k_row, d2], mask=m, other=0),
                       plgpu.load(qkv_ref.at[k_row, d2 + h2], mask=m, other=0), c, s, dt)
        v = plgpu.load(qkv_ref.at[k_row + kv_heads, dH], mask=m, other=0).astype(dt)
        return k1, k2, v

    # Every store below is unmasked and every lane's target its own or a clone's with the
    # same value (the outputs are padded to whole tiles), so that no masked lane of a store
    # is needed: interpret mode writes a masked lane's old value, which may race a live one.
    # This tile's own rows of the prompt's k and v, handed back for the cache.
    u = t0 + jnp.arange(tile, dtype=jnp.int32)
    k1, k2, v = new_kv(u)
    plgpu.store(k_out.at[u[:, None], d2], k1)
    plgpu.store(k_out.at[u[:, None], d2 + h2], k2)
    plgpu.store(v_out.at[u[:, None], dH], v)

    # The tile's query rows (token-major, then the group's heads), rotated; rows past
    # tile x group (padding to a power of two) repeat the first ones.
    r = jnp.arange(rows, dtype=jnp.int32) % (tile * group)
    t_r, g_r = t0 + r // group, r % group
    q_row = (t_r * C + kh * group + g_r)[:, None]
    m = (t_r < tokens)[:, None]
    c, s = angles(t_r)
    q1, q2 = _rope(plgpu.load(qkv_ref.at[q_row, d2], mask=m, other=0),
                   plgpu.load(qkv_ref.at[q_row, d2 + h2], mask=m, other=0), c, s, dt)

    def update(carry, ka, kb, vb, seen):  # online softmax over one block of keys
        acc, m, l = carry
        logit = dot_f32(q1, ka, trans_b=True, precision=precision) + dot_f32(q2, kb, trans_b=True,
                                                                           precision=precision)
        logit = jnp.where(seen, logit * scale_log2, _NEG)  # [rows, block_k]
        m_new = jnp.maximum(m, logit.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(seen, jnp.exp2(logit - m_new[:, None]), 0.0)
        l = l * alpha + p.sum(axis=1)
        return acc * alpha[:, None] + dot_f32(p.astype(dt), vb, precision=precision), m_new, l

    j_off = jnp.arange(block_k, dtype=jnp.int32)

    def cached(i, carry):  # rows 0 .. start-1 of the cache: before every query
        j = i * block_k + j_off
        ok = j < start
        m = ok[:, None]
        rows_j = pl.ds(i * block_k, block_k)
        ka = plgpu.load(kv_ref.at[layer, k_at, kh, rows_j, pl.ds(0, h2)], mask=m, other=0)
        kb = plgpu.load(kv_ref.at[layer, k_at, kh, rows_j, pl.ds(h2, h2)], mask=m, other=0)
        vb = plgpu.load(kv_ref.at[layer, v_at, kh, rows_j, pl.ds(0, H)], mask=m, other=0)
        return update(carry, ka, kb, vb, jnp.broadcast_to(ok[None, :], (rows, block_k)))

    def prompt(i, carry):  # the prompt's rows up to each query's own
        j = i * block_k + j_off
        ok = j < tokens
        ka, kb, vb = new_kv(j)
        return update(carry, ka, kb, vb, ok[None, :] & (j[None, :] <= t_r[:, None]))

    init = (jnp.zeros((rows, H), f32), jnp.full((rows,), _NEG, f32), jnp.zeros((rows,), f32))
    carry = lax.fori_loop(0, pl.cdiv(start, block_k), cached, init)
    last = jnp.minimum(t0 + tile, tokens)  # the tile's last token + 1
    acc, _, l = lax.fori_loop(0, pl.cdiv(last, block_k), prompt, carry)
    o = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)
    plgpu.store(o_ref.at[(t_r * num_heads + kh * group + g_r)[:, None], dH], o)


def tiling(tokens: int, group: int) -> tuple[int, int]:
    """(tokens a program, its query rows): as many tokens as fit `ROWS` rows with the group's
    heads, no more than the prompt has; rows a power of two of at least 16."""
    tile = max(1, min(ROWS // next_pow2(group), next_pow2(tokens)))
    return tile, max(16, next_pow2(tile * group))


def check(qkv_TCH, kv_LTKSH, layer, start, cos_Th, sin_Th, num_heads: int):
    """Shape and dtype checks (a layer given as an int: its range too; a traced one is
    clamped to the cache's layers); errors name the argument and the fix."""
    T, C, H = qkv_TCH.shape
    if kv_LTKSH.ndim != 5 or kv_LTKSH.shape[1] != 2 or kv_LTKSH.shape[4] != H:
        raise ValueError(f"prompt_attention: the cache must be [layers, 2, kv_heads, rows, head_dim={H}]; "
                         f"got {kv_LTKSH.shape}")
    L, _, K, _, _ = kv_LTKSH.shape
    if isinstance(layer, int) and not 0 <= layer < L:
        raise ValueError(f"prompt_attention: layer={layer} is not one of the cache's {L} layers")
    if num_heads % K or C != num_heads + 2 * K:
        raise ValueError(f"prompt_attention: q|k|v has {C} heads; expected num_heads + 2 * kv_heads = "
                         f"{num_heads} + 2 * {K} with num_heads a multiple of kv_heads")
    if not supports(H):
        raise ValueError(f"prompt_attention: head_dim={H} must be a power of two >= 32; use the XLA "
                         "attention (ChainCache(prompt_kernels=False))")
    if jnp.shape(start) != (1,) or cos_Th.shape != (T, H // 2) or sin_Th.shape != (T, H // 2):
        raise ValueError(f"prompt_attention: start must be [1] and cos/sin [tokens, head_dim/2]=({T}, {H // 2}); "
                         f"got {jnp.shape(start)}, {cos_Th.shape}, {sin_Th.shape}")


def prompt_attention(qkv_TCH, kv_LTKSH, start, cos_Th, sin_Th, *, layer, num_heads: int,
                     sm_scale: float | None = None, block_k: int = 32, num_warps: int = 4,
                     num_stages: int = 2, interpret: bool | None = None):
    """(o [T, N, H], the prompt's rows [2, K, T, H]: rotated k, v) of a prompt of T tokens at
    positions start … start+T-1 of one sequence, attending to the cache's rows 0 … start-1 of
    `layer` and causally to its own.

    qkv_TCH: the fused projection of the prompt, heads q (N), k (K), v (K) a token;
    kv_LTKSH: the cache [L, 2, K, S, H] (read only; rows past start are not read);
    start [1] int32: the cached length (clamped to [0, S]); layer: an int, or a traced int32
    scalar (a layer scan's index; clamped to [0, L-1]); cos_Th, sin_Th fp32 [T, H/2]: the
    prompt's RoPE angles (`gendist.models.layers.rope_angles`).
    """
    check(qkv_TCH, kv_LTKSH, layer, start, cos_Th, sin_Th, num_heads)
    where = jnp.concatenate([jnp.reshape(start, (1,)), jnp.reshape(layer, (1,))]).astype(jnp.int32)
    return _prompt_attention(qkv_TCH, kv_LTKSH, where, cos_Th, sin_Th, num_heads=num_heads,
                             sm_scale=sm_scale, block_k=block_k, num_warps=num_warps,
                             num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_heads", "sm_scale", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def _prompt_attention(qkv_TCH, kv_LTKSH, where, cos_Th, sin_Th, *, num_heads: int, sm_scale, block_k: int,
                      num_warps: int, num_stages: int, interpret):
    T, C, H = qkv_TCH.shape
    _, _, K, S, _ = kv_LTKSH.shape
    tile, rows = tiling(T, num_heads // K)
    T_pad = pl.cdiv(T, tile) * tile  # whole tiles: every store lands in the outputs
    scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)
    kernel = functools.partial(_kernel, num_heads=num_heads, kv_heads=K, tokens=T, tile=tile, rows=rows,
                               block_k=block_k, scale_log2=scale * _LOG2E,
                               precision=precision_for(kv_LTKSH.dtype))
    whole = lambda *shape: pl.BlockSpec(shape, lambda k, q: (0,) * len(shape))  # noqa: E731
    o, k_new, v_new = pl.pallas_call(
        kernel, grid=(K, pl.cdiv(T, tile)),
        in_specs=[whole(2), whole(T * C, H), whole(T, H // 2), whole(T, H // 2), whole(*kv_LTKSH.shape)],
        out_specs=[whole(T_pad * num_heads, H), *[pl.BlockSpec((None, T_pad, H), lambda k, q: (k, 0, 0))] * 2],
        out_shape=[jax.ShapeDtypeStruct((T_pad * num_heads, H), kv_LTKSH.dtype),
                   *[jax.ShapeDtypeStruct((K, T_pad, H), kv_LTKSH.dtype)] * 2],
        interpret=resolve_interpret(interpret),
        name=f"prompt_attention_t{tile}",
        compiler_params=triton_params(num_warps, num_stages),
    )(where, qkv_TCH.reshape(T * C, H), cos_Th.astype(jnp.float32), sin_Th.astype(jnp.float32), kv_LTKSH)
    return o.reshape(T_pad, num_heads, H)[:T], jnp.stack([k_new, v_new])[:, :, :T]


def prompt_attention_reference(qkv_TCH, kv_LTKSH, start, cos_Th, sin_Th, *, layer, num_heads: int,
                               sm_scale: float | None = None):
    """The unfused math in jnp: rotate, write the rows at start, softmax over the positions
    each query sees."""
    T, C, H = qkv_TCH.shape
    _, _, K, S, _ = kv_LTKSH.shape
    dt = kv_LTKSH.dtype
    scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)
    rot = lambda x_TXH: rope_reference(x_TXH, cos_Th[:, None, :], sin_Th[:, None, :], dt)  # noqa: E731
    q = rot(qkv_TCH[:, :num_heads])
    rows = jnp.stack([rot(qkv_TCH[:, num_heads:num_heads + K]),
                      qkv_TCH[:, num_heads + K:].astype(dt)]).transpose(0, 2, 1, 3)  # [2, K, T, H]
    start = jnp.clip(start[0], 0, S)
    kv = jax.lax.dynamic_update_slice(kv_LTKSH[layer], rows, (0, 0, start, 0))
    pos = start + jnp.arange(T)
    hi = jax.lax.Precision.HIGHEST  # XLA would use TF32 for fp32 on a GPU
    q_KGTH = q.reshape(T, K, num_heads // K, H).transpose(1, 2, 0, 3)
    logits = jnp.einsum("kgth,ksh->kgts", q_KGTH, kv[0], precision=hi, preferred_element_type=jnp.float32)
    seen = jnp.arange(S)[None, :] <= pos[:, None]  # [T, S]
    p = jax.nn.softmax(jnp.where(seen, logits * scale, -jnp.inf), axis=-1)
    o = jnp.einsum("kgts,ksh->kgth", p.astype(dt), jnp.where(seen.any(0)[:, None], kv[1], 0), precision=hi,
                   preferred_element_type=jnp.float32)  # batch-major (XLA:CPU 0.11's bf16 dot)
    return o.transpose(2, 0, 1, 3).reshape(T, num_heads, H).astype(dt), rows
