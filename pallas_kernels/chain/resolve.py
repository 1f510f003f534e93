"""`chain_mgpu`'s inputs checked and its options resolved for a shape (plain Python on
shapes): what one call of the decode megakernel runs (`Call`), how it runs it (`Schedule`),
and the shared memory it takes.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from pallas_kernels._mgpu import SMEM_LIMIT, sm_count, smem_bytes
from pallas_kernels.chain import attention as ca
from pallas_kernels.chain.plan import (
    KC,
    MAX_LAYERS,
    T,
    default_loads,
    head_product,
    kept_layout,
    layout,
    products,
    state_words,
    tag,
    tuned,
)

MAX_STEPS = 64  # greedy steps a call at most (`chain_mgpu(steps=N)`; the epochs a call spans)


def window_rows(kmax: int) -> int:
    """Rows of the bf16 input window: chunk i is the 8-row tile at row 8 i (its row 0 the
    values, rows 1-7 whatever they hold: they reach only accumulator columns never read)."""
    return 8 * kmax


def smem_need(kmax: int, stages: int, tiles: int = 1) -> int:
    """Bytes of the kernel's own shared memory (`kernel.kernel_call`'s scratch without the
    attention's and the output layer's): the input window, the ring, the tiles' outputs."""
    return smem_bytes(((window_rows(kmax), KC), jnp.bfloat16), ((stages, T, KC), jnp.bfloat16),
                      ((tiles, T), jnp.float32), ((T,), jnp.float32), ((4,), jnp.float32))


def check(x0_D, w_qkv, w_o, w_gu, w_down):
    """Raises a ValueError naming what does not fit; returns (L, D, N1, F). x0_D None: x_0
    comes from an embedding table (`chain_mgpu(embed=...)`), D from the weights."""
    x0_shape = x0_D.shape if x0_D is not None else w_o.shape[-1:]
    shapes = (x0_shape, *(a.shape for a in (w_qkv, w_o, w_gu, w_down)))
    wrong = ValueError(f"chain_mgpu: x0 {shapes[0]}, w_qkv {shapes[1]}, w_o {shapes[2]}, w_gu "
                       f"{shapes[3]}, w_down {shapes[4]}: want [D], [L, N1, D], [L, D, D], "
                       "[L, 2F, D], [L, D, F] with N1 >= D.")
    if [len(s) for s in shapes] != [1, 3, 3, 3, 3]:
        raise wrong
    (D,), (L, N1, D1), (L2, D2, D3), (L3, G, D4), (L4, D5, F) = shapes
    if len({L, L2, L3, L4}) != 1 or len({D, D1, D2, D3, D4, D5}) != 1 or G != 2 * F or N1 < D:
        raise wrong
    if D % T or N1 % T or F % T:
        raise ValueError(f"chain_mgpu: D={D}, N1={N1}, F={F} must be multiples of {T}.")
    if any(jnp.dtype(w.dtype) != jnp.bfloat16 for w in (w_qkv, w_o, w_gu, w_down)):
        raise ValueError("chain_mgpu: the weights must be bf16.")
    return L, D, N1, F


def check_attention(kv, pos, rope, L: int, D: int, N1: int):
    """Raises a ValueError naming what does not fit the attention phase; returns (H, S, hd)."""
    if kv.ndim != 5 or kv.shape[0] != L or kv.shape[1] != 2:
        raise ValueError(f"chain_mgpu: kv {kv.shape}: want [L={L}, 2, heads, capacity, head_dim].")
    H, S, hd = kv.shape[2:]
    if D % hd or (D // hd) % H or N1 != D + 2 * H * hd:
        raise ValueError(f"chain_mgpu: kv heads {H} x head_dim {hd}: want D={D} a multiple of "
                         f"head_dim (D / head_dim query heads), kv heads dividing the query heads "
                         f"and N1={N1} equal to D + 2 kv_heads head_dim (q|k|v of grouped-query "
                         "attention; 3 D for multi-head).")
    if hd % T or S % T:
        raise ValueError(f"chain_mgpu: head_dim={hd} and capacity={S} must be multiples of {T}.")
    if jnp.dtype(kv.dtype) != jnp.bfloat16:
        raise ValueError("chain_mgpu: the kv cache must be bf16.")
    if pos.shape != (1,) or not (rope.shape == (hd,) or (rope.ndim == 2 and rope.shape[0] >= S
                                                          and rope.shape[1] == hd)):
        raise ValueError(f"chain_mgpu: pos {pos.shape}, rope {rope.shape}: want [1] (int32) and "
                         f"[head_dim={hd}] (cos | sin of the new token's angles) or a table "
                         f"[rows >= capacity={S}, head_dim={hd}] of every position's.")
    return H, S, hd


class Schedule(NamedTuple):
    """How the kernel runs a chain, `chain_mgpu`'s options of these names (its docstring):
    the ring's stages, the tile pieces a block makes at a time, the tensor-core products and
    the weight tiles it keeps in flight, the L2 prefetch ahead of its ring, the norms' square
    sums, pieces two values a word, the trace points, the weight tiles in flight of an
    attention block (None: loads) and the attention blocks a query group's positions are
    split over. Only packed (the pieces' rounding), norm_sums (the squares' order) and
    att_splits (each split's softmax, merged) change the values computed."""

    stages: int = 16
    tiles: int = 1
    inflight: int = 1
    loads: int | None = None
    prefetch: int = 0
    norm_sums: bool = True
    packed: bool = True
    trace: bool = False
    att_loads: int | None = None
    att_splits: int = 1


class Call(NamedTuple):
    """What one `chain_mgpu` call runs: the chain's sizes, the blocks, the attention inputs
    (kv, pos, rope cast) or None, the query heads an attention block takes, the layer's
    products with their splits, the output layer (w_head, its product) or None, and the
    int32 words of a kept state (`chain_mgpu(state=...)`), the embedding (table, token as
    int32) x_0 is read from, or None, the schedule with its defaults resolved for the
    shape (loads None: `plan.default_loads`) and the greedy steps a call runs."""

    L: int
    D: int
    N1: int
    F: int
    blocks: int
    attn: tuple | None
    group: int
    prods: tuple
    head: tuple | None
    state_words: int
    embed: tuple | None
    sched: Schedule
    steps: int = 1  # greedy steps a call (`chain_mgpu(steps=N)`)


def resolve(x0_D, w_qkv, w_o, w_gu, w_down, kv, pos, rope, sched: Schedule, *,
            blocks: int | None = None, norm_eps: float | None = None, splits: tuple | None = None,
            spare: bool | None = None, group: int | None = None, w_head=None, kept: bool = False,
            embed=None, steps: int = 1) -> Call:
    """`chain_mgpu`'s inputs checked and its options resolved for their shape (the measured
    splits, o's blocks and the attention group where not given, `plan.tuned`); a ValueError
    names whatever does not fit, and the fix."""
    stages, tiles, inflight, loads, prefetch, packed = (sched.stages, sched.tiles, sched.inflight,
                                                        sched.loads, sched.prefetch, sched.packed)
    L, D, N1, F = check(x0_D, w_qkv, w_o, w_gu, w_down)
    NB = blocks or sm_count()
    attn = None
    if kv is not None:
        H, S, hd = check_attention(kv, pos, rope, L, D, N1)
        attn = (kv, pos.astype(jnp.int32), rope.astype(jnp.float32))
        best_splits, best_spare, _ = tuned(D, N1, F, NB, hd)
        per_kv = D // hd // H
        group = attention_group(D, N1, F, NB, hd, H, group)
        if not (1 <= group <= 8 and per_kv % group == 0):
            raise ValueError(f"chain_mgpu: group={group}: want a divisor of the {per_kv} query heads "
                             "a kv head serves, at most 8.")
    else:
        group, best_splits, best_spare = 1, (), False
    R = sched.att_splits
    if not 1 <= R <= 8 or (R > 1 and attn is None):
        raise ValueError(f"chain_mgpu: att_splits={R}: want 1 to 8 attention blocks a query group, "
                         "each attending to a split of the positions (with kv, pos and rope).")
    heads = attention_blocks(D, hd, group, R) if attn is not None else 0
    splits = best_splits if splits is None else splits
    att_blocks = heads if (best_spare if spare is None else spare) else 0
    if att_blocks >= NB:
        raise ValueError(f"chain_mgpu: {att_blocks} attention blocks leave none of blocks={NB} "
                         "for o; use spare=False or more blocks.")
    prods = products(D, N1, F, NB, attention=attn is not None, splits=splits, att_blocks=att_blocks)
    head = None
    if w_head is not None:
        if w_head.ndim != 2 or w_head.shape[1] != D or w_head.shape[0] % T or w_head.dtype != jnp.bfloat16:
            raise ValueError(f"chain_mgpu: w_head {w_head.shape} {w_head.dtype}: want [V, D={D}] bf16 "
                             f"with V a multiple of {T}; leave the output layer to XLA otherwise.")
        head = (w_head, head_product(w_head.shape[0], D, NB, whole_rows=steps > 1))
    kmax = max(p.kmax() for p in prods + ((head[1],) if head else ()))
    need = (smem_need(kmax, stages, tiles) + (0 if attn is None else attention_smem(S, hd, group, R))
            + (2 * T * 4 if head else 0) + (2 * T * 4 + 48 if steps > 1 else 0))
    if need > SMEM_LIMIT - 2048:
        raise ValueError(f"chain_mgpu: stages={stages} needs {need} bytes of shared memory; use fewer.")
    if norm_eps is not None and D % 128:
        raise ValueError(f"chain_mgpu: norms need D={D} to be a multiple of 128.")
    if attn is not None and (kmax < hd // T or heads > NB):
        raise ValueError(f"chain_mgpu: head_dim={hd} needs a window of {hd // T} chunks (has "
                         f"{kmax}) and {heads} attention blocks (att_splits={R} a query group) at most blocks={NB}.")
    if not 1 <= tiles <= 8:
        raise ValueError(f"chain_mgpu: tiles={tiles}: want 1 to 8 tile pieces a block makes at a "
                         "time (one accumulator each).")
    if packed and tag(L - 1) > 0xFFFF:
        raise ValueError(f"chain_mgpu: packed=True tags words with 16 bits: {L} layers are too many; "
                         "use packed=False.")
    if not 1 <= inflight < min(stages, 8):
        raise ValueError(f"chain_mgpu: inflight={inflight}: want 1 to {min(stages, 8) - 1} wgmma products "
                         "left in flight behind the one just issued (fewer than the ring's stages).")
    if loads is None:  # the measured default; a cap of the ring's stages or more caps nothing
        loads = default_loads(D)
        loads = loads if loads < stages else 0
        sched = sched._replace(loads=loads)
    if not 0 <= loads < stages:
        raise ValueError(f"chain_mgpu: loads={loads}: want 0 (as many weight tiles in flight as the "
                         f"ring has free slots) or 1 to {stages - 1} (fewer than the ring's stages).")
    att_loads = sched.att_loads
    if att_loads is not None and not 0 <= att_loads < stages:
        raise ValueError(f"chain_mgpu: att_loads={att_loads}: want None (as loads), 0 (the ring's free "
                         f"slots) or 1 to {stages - 1} weight tiles in flight for an attention block.")
    if prefetch < 0:
        raise ValueError(f"chain_mgpu: prefetch={prefetch}: want 0 (off) or the weight tiles a block "
                         "asks of L2 ahead of its ring.")
    if kept and attn is None:
        raise ValueError("chain_mgpu: state keeps the words of a decode loop's calls and writes the new k "
                         "and v into the cache: pass kv, pos and rope, or leave state=None.")
    if kept and L > MAX_LAYERS:
        raise ValueError(f"chain_mgpu: a kept state tags words with the layer in 8 bits: {L} layers are "
                         f"more than {MAX_LAYERS}; leave state=None.")
    if kept and kv.size >= 2 ** 31:
        raise ValueError(f"chain_mgpu: the kernel writes the new k and v at 32-bit offsets into kv "
                         f"{kv.shape}, which is too large; leave state=None.")
    if embed is not None:
        if not kept:
            raise ValueError("chain_mgpu: embed=(table, token) writes x_0's words into the kept state: "
                             "pass state=..., or x0_D.")
        table, token = embed
        if table.ndim != 2 or table.shape[1] != D or table.dtype != jnp.bfloat16 or token.shape != (1,):
            raise ValueError(f"chain_mgpu: embed table {table.shape} {table.dtype}, token {token.shape}: "
                             f"want [V, D={D}] bf16 and [1] int32.")
        if table.size >= 2 ** 32:
            raise ValueError(f"chain_mgpu: the embedding table {table.shape} is read at 32-bit offsets; "
                             "pass x0_D instead.")
        embed = (table, token.astype(jnp.int32))
    if steps != 1 and not (1 <= steps <= MAX_STEPS and embed is not None and head is not None
                           and norm_eps is not None and R == 1 and L <= 32):
        raise ValueError(f"chain_mgpu: steps={steps}: want 1, or 2 to {MAX_STEPS} greedy steps a call, "
                         "which take the token's row (embed=..., with state=...), the output layer "
                         "(w_head=...), the norms (norm_eps=...), att_splits=1 (a step's new k and v "
                         "are read by the block that wrote them) and at most 32 layers.")
    lay = layout(prods, D, attn is not None, packed, R)
    # a kept state with the host's words and the output layer also holds the greedy choices'
    # words (whether or not this call chooses), so that one state serves calls of any steps
    greedy = min(head[1].tiles, NB) if embed is not None and head is not None else 0
    words = state_words(kept_layout(lay), greedy) if embed is not None else state_words(lay)
    return Call(L, D, N1, F, NB, attn, group, prods, head, words, embed, sched, steps)


def attention_group(D: int, N1: int, F: int, blocks: int, head_dim: int, kv_heads: int,
                    group: int | None = None) -> int:
    """The query heads an attention block takes: `group` if given, else the shape's measured
    choice (`plan.tuned`), else `attention.default_group`."""
    return group or tuned(D, N1, F, blocks, head_dim)[2] or ca.default_group(D // head_dim, kv_heads, blocks)


def attention_blocks(D: int, head_dim: int, group: int, splits: int = 1) -> int:
    """The blocks that attend: one a query group (`group` query heads) and split of its
    positions. The grid must hold them (with o spared, leave o at least one)."""
    return D // head_dim // group * splits


def attention_smem(S: int, hd: int, group: int = 1, splits: int = 1) -> int:
    """Bytes of the attention phase's shared memory (`kernel.kernel_call`'s att_scratch)."""
    return smem_bytes(((8 * (S // T), KC), jnp.bfloat16), ((group, S // T, T), jnp.float32),
                      (((group + 2) * hd,), jnp.float32), ((group * ca.RED,), jnp.float32),
                      ((hd,), jnp.float32), ((group, T), jnp.float32),
                      *((((group, T), jnp.float32),) if splits > 1 else ()))
