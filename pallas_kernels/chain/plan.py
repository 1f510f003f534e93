"""The plan of `chain_mgpu`'s decode chain megakernel, in plain Python (CPU-testable): how
each weight product's [row tiles, chunks] items split over the blocks (`choose_split`, a cost
model fitted to the H200's handover prices), where every low-latency (LL) word lives
(`layout`, `piece_word`) and where each product's input is read from (`input_spec`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

T = 64  # rows of a weight tile (wgmma N) and of an activation chunk
KC = 64  # columns of a weight tile (one chunk of K)
_ITEM_US = 0.26  # one 8 KB tile per SM at ~4.1 TB/s over 132 SMs


def poll_us(sources: int) -> float:
    """A handover's cost in stream time when each reader waits for `sources` writers' words,
    fitted to the H200's (probe_tma_stream mode ll: 0.23 / 0.48 / 0.59 / 1.00 / 1.34 / 1.64 /
    2.09 us for 1 / 2 / 3 / 8 / 16 / 32 / 64 sources): about 0.2 + 0.3 log2(sources)."""
    return 0.2 + 0.3 * math.log2(max(sources, 1))


@dataclasses.dataclass(frozen=True)
class Split:
    """A product's [tiles, chunks] items in sk chunk groups x st tile groups (sk * st blocks)."""

    sk: int
    st: int


@dataclasses.dataclass(frozen=True)
class Product:
    name: str
    N: int  # output rows
    K: int  # input width
    split: Split

    @property
    def tiles(self) -> int:
        return self.N // T

    @property
    def chunks(self) -> int:
        return self.K // KC

    def kmax(self) -> int:
        """The most chunks a block reads."""
        return -(-self.chunks // self.split.sk)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_costs(tiles: int, chunks: int, blocks: int, sources_in: int = 1,
                fan_out: int = 1) -> list[tuple[float, Split]]:
    """Every rectangle split's estimated time, the cheapest first (ties: fewer chunk groups,
    then fewer tile groups): the busiest block's items at the stream's per-SM rate, its
    polling passes (two chunks a pass; the first waits, the others find their words written)
    over `sources_in` sources each, and the handover its own pieces cost the next product's
    readers (sk * fan_out sources)."""
    out = []
    for sk in range(1, chunks + 1):
        for st in range(1, min(tiles, blocks // sk) + 1):
            items = -(-tiles // st) * -(-chunks // sk)
            passes = -(-cdiv(chunks, sk) // 2)
            cost = (items * _ITEM_US + poll_us(sources_in) + (passes - 1) * 0.2
                    + poll_us(sk * fan_out))
            out.append((cost, Split(sk, st)))
    return sorted(out, key=lambda c: (c[0], c[1].sk, c[1].st))


def choose_split(tiles: int, chunks: int, blocks: int, sources_in: int = 1, fan_out: int = 1) -> Split:
    """The split with the least estimated time (`split_costs`)."""
    return split_costs(tiles, chunks, blocks, sources_in, fan_out)[0][1]


def products(D: int, N1: int, F: int, blocks: int, attention: bool = False,
             splits: tuple = (), att_blocks: int = 0, ranked: dict | None = None) -> tuple[Product, ...]:
    """The layer's four products with their splits (qkv, o, gate|up, down). attention: o
    reads the attention phase's dense output (one source a chunk), not q|k|v's pieces.
    splits: ((name, sk, st), ...) overriding the cost model's choice for those products (a
    sweep's knob: `experiments/sweep_chain_splits.py`). att_blocks: o is split over the
    first blocks - att_blocks blocks only, sparing the attention blocks (the last ones,
    `attention.head_of`): they are still attending when o's input arrives, while the others
    have had o's weights streaming into their rings since q|k|v. ranked: a dict to fill with
    each product's `split_costs` as the cost model saw them (the tuner's candidates)."""
    chosen = {name: Split(sk, st) for name, sk, st in splits}
    unknown = set(chosen) - {"qkv", "o", "gu", "down"}
    if unknown:
        raise ValueError(f"products: splits names {sorted(unknown)}; use qkv, o, gu or down.")
    out, sources = [], 2  # the first reads the previous down's pieces and a residual
    # fan_out: sources a reader of this product's pieces polls per piece set (gate and up;
    # a residual beside qkv's and o's readers... counted as 1 extra by sources_in below).
    if not 0 <= att_blocks < blocks:
        raise ValueError(f"products: att_blocks={att_blocks} must lie in [0, blocks={blocks}).")
    for name, N, K, fan in (("qkv", N1, D, 1), ("o", D, D, 1), ("gu", 2 * F, D, 2), ("down", D, F, 1)):
        usable = blocks - att_blocks if name == "o" else blocks
        costs = split_costs(N // T, K // KC, usable, sources, fan)
        if ranked is not None:
            ranked[name] = costs
        split = chosen.get(name) or costs[0][1]
        if not (1 <= split.sk <= K // KC and 1 <= split.st <= N // T and split.sk * split.st <= usable):
            raise ValueError(f"products: splits {name}=(sk {split.sk}, st {split.st}) needs 1 <= sk <= "
                             f"{K // KC} chunks, 1 <= st <= {N // T} tiles and sk * st <= {usable} blocks.")
        out.append(Product(name, N, K, split))
        sources = split.sk * fan + (name in ("o", "down"))
        if name == "qkv" and attention:
            sources = 1
    return tuple(out)


def head_product(V: int, D: int, blocks: int, whole_rows: bool = False) -> Product:
    """The output layer as the kernel's last product (`chain_mgpu(w_head=...)`): V rows of
    D, after the last layer. Its pieces are not polled by any block: each chunk group's go to
    the kernel's output, summed by the caller. The split: the fewest weight tiles on the
    busiest block, with the pieces' bytes (sk x V fp32, written once and read once)
    counted as tiles of the stream (8 KB each, over every block). whole_rows: one piece a
    tile (sk 1, the tiles over min(V / 64, blocks) blocks), so that a block's sums are the
    logits themselves (`chain_mgpu(steps=N)`'s greedy choice)."""
    tiles, chunks = V // T, D // KC
    if whole_rows:  # each block sums its tiles' rows whole (the kernel's greedy choice, `greedy`)
        return Product("head", V, D, Split(1, min(tiles, blocks)))
    best = None
    for sk in range(1, chunks + 1):
        st = min(tiles, blocks // sk)
        if st < 1:
            break
        cost = cdiv(tiles, st) * cdiv(chunks, sk) + sk * V * 8 / (T * KC * 2 * blocks)
        if best is None or cost < best[0]:
            best = (cost, Split(sk, st))
    return Product("head", V, D, best[1])


# Splits, o's blocks and attention groups measured faster than the cost model's in whole decode
# steps on an H200 (350m's on an H100: both 132 SMs; benchmarks/decode.md, `decode_floor.py --variants chain@...`,
# `experiments/tune_chain_splits.py`), by (D, N1, F, blocks, head_dim): (splits over the cost
# model's, spare, group (None: `attention.default_group`)), with chain_mgpu's default options (the
# norms' square sums and packed pieces) unless noted. Elsewhere the cost model's splits
# with o over every block and `attention.default_group`'s query heads an attention block.
MEASURED = {
    (2048, 6144, 5632, 132, 128): ((("qkv", 16, 8),), False, None),  # 1b: 0.713 ms, not 0.721
    # 350m: 0.327 ms, not 0.342 (an H100, loads 2); on an H200 0.307 against the old choice's 0.310
    (1024, 3072, 2816, 132, 64): ((("qkv", 4, 24),), False, None),
}  # Llama-3.2-1B's shape: the defaults (0.696 ms, the best of 20 candidates)


def default_loads(D: int) -> int:
    """The weight tiles a block's producer keeps in flight by default (`chain_mgpu`'s loads)
    at width D, measured in whole decode steps on an H200 (benchmarks/decode.md, "Weight
    tiles in flight"): 6 at d 2048 (Llama-3.2-1B's shape and `1b`, 3-6% faster than the
    ring's 16 free slots; 5-7 within 1%), 2 at d 1024 (`350m`, 9% faster; 1 is 48% slower).
    Widths between and above take the nearer measured width's; not timed."""
    return 2 if D <= 1024 else 6


def tuned(D: int, N1: int, F: int, blocks: int, head_dim: int) -> tuple[tuple, bool, int | None]:
    """(splits, spare, group) for a shape: `MEASURED`'s, else the cost model's splits with o
    over every block and the default group (((), False, None))."""
    return MEASURED.get((D, N1, F, blocks, head_dim), ((), False, None))


def predict_us_per_layer(D: int, N1: int, F: int, blocks: int) -> float:
    """The cost model's µs a layer: for each product its busiest block's tiles at the
    stream's per-SM rate, then its readers' poll (the sources each waits for), serially."""
    prods = products(D, N1, F, blocks)
    qkv, o, gu, down = prods
    sources = {"qkv": down.split.sk + 1, "o": qkv.split.sk, "gu": o.split.sk + 1, "down": 2 * gu.split.sk}
    total = 0.0
    for p in prods:
        rects = [rect(p, b) for b in range(blocks)]
        busiest = max((t1 - t0) * (k1 - k0) for active, t0, t1, k0, k1 in rects if active)
        total += busiest * _ITEM_US + poll_us(sources[p.name]) + (cdiv(p.kmax(), 2) - 1) * 0.2
    return total


def rect(p: Product, b):
    """Block b's rectangle of product p: (active, t0, t1, k0, k1); works on ints and traced."""
    gk, gt = b // p.split.st, b % p.split.st
    active = b < p.split.sk * p.split.st
    k0, k1 = gk * p.chunks // p.split.sk, (gk + 1) * p.chunks // p.split.sk
    t0, t1 = gt * p.tiles // p.split.st, (gt + 1) * p.tiles // p.split.st
    return active, t0, t1, k0, k1


def schedule(D: int, N1: int, F: int, blocks: int):
    """{product name: [(block, t0, t1, k0, k1) for active blocks]}: the decomposition."""
    return {p.name: [(b, *rect(p, b)[1:]) for b in range(blocks) if rect(p, b)[0]]
            for p in products(D, N1, F, blocks)}


MAX_POLL_WORDS = 64  # LL words one lane may poll in one round trip (registers)


@dataclasses.dataclass(frozen=True)
class Reads:
    """One poll round of an input gather (`words.gather`): lanes < 64 read column lane
    of chunk chunks[0] + i * chunk_step into slot slots[0] + i * slot_step, lanes >= 64
    column lane - 64 of chunks[1] + i * chunk_step into slots[1] + i * slot_step, for every
    pass i < passes whose chunk is below `limit`: every pass's words polled together, one
    round trip to L2 for all. chunks, slots, limit: ints or traced."""

    chunks: tuple
    slots: tuple
    limit: object
    passes: int
    chunk_step: int = 2
    slot_step: int = 2

    def expand(self):
        """[(chunk, slot)] this round writes (ints only; the tests' view of the kernel's)."""
        return [(c + i * self.chunk_step, s + i * self.slot_step)
                for i in range(self.passes) for c, s in zip(self.chunks, self.slots, strict=True)
                if c + i * self.chunk_step < self.limit]


def rounds(reads: Reads, words: int) -> list[Reads]:
    """reads split into rounds of at most MAX_POLL_WORDS // words passes (words: LL words a
    pass polls a lane)."""
    per = max(1, MAX_POLL_WORDS // max(words, 1))
    out = []
    for first in range(0, reads.passes, per):
        out.append(dataclasses.replace(
            reads, passes=min(per, reads.passes - first),
            chunks=tuple(c + first * reads.chunk_step for c in reads.chunks),
            slots=tuple(s + first * reads.slot_step for s in reads.slots)))
    return out


def product_reads(p: Product, k0, k1, words: int) -> list[Reads]:
    """A product's input chunks k0..k1-1 into window slots 0..k1-k0-1: two chunks a pass, its
    kmax chunks' passes in as few rounds as the lane's words allow."""
    return rounds(Reads((k0, k0 + 1), (0, 1), k1, cdiv(p.kmax(), 2)), words)


def head_reads(D: int, h: int, hd: int, words: int, kv_heads: int | None = None,
               group: int = 1) -> list[Reads]:
    """Attention block h's q, k and v from q|k|v (D / hd query heads, then kv_heads k heads,
    then kv_heads v heads, hd / 64 chunks each; kv_heads None: as many as query heads): the
    `group` query heads h group .. (h + 1) group - 1 into stage slots g nc + j (nc = hd / 64,
    j < nc), their kv head's k into slots group nc + j and its v into (group + 1) nc + j."""
    nc, step = hd // T, D // T
    N = D // hd
    K = N if kv_heads is None else kv_heads
    first = h * group * nc
    if K == N:  # multi-head: q, k and v of head h are step chunks apart
        if nc == 1:  # q | k in the first pass, v in the second (k + step is past the limit)
            return rounds(Reads((first, first + step), (0, 1), first + 2 * step + 1, 2, 2 * step, 2), words)
        if nc == 2:  # q, k, v: a pass each
            return rounds(Reads((first, first + 1), (0, 1), first + 2 * step + 2, 3, step, 2), words)
        return [r for k in range(3) for r in rounds(
            Reads((first + k * step, first + k * step + 1), (k * nc, k * nc + 1), first + k * step + nc,
                  cdiv(nc, 2)), words)]
    # grouped: the group's q chunks two a pass, then k (low lanes) and v (high lanes) a pass a chunk
    j = h * group // (N // K)  # the kv head
    nq, k0, v0 = group * nc, step + j * nc, step + (K + j) * nc
    return (rounds(Reads((first, first + 1), (0, 1), first + nq, cdiv(nq, 2)), words)
            + rounds(Reads((k0, v0), (nq, nq + nc), v0 + nc, nc, 1, 1), words))


SS = 32  # values a square-sum word covers (a warp's: `Layout`'s Xss, Hss)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Word offsets (8-byte LL words) of each layer's regions in the semaphore array: every
    product's pieces [tiles, sk, 64], the dense residuals X_l (qkv's input, l >= 1) and
    H_l (gate|up's input), their square sums Xss_l and Hss_l (word i: the sum of squares of
    values SS i .. SS (i + 1) - 1, all an RMSNorm's readers need of the vector), and with
    attention its dense output A_l (o's input, "att"). `init` is the layout of the
    host-written words standing in for layer -1: the down pieces (zeros), H_{-1} = x_0 and
    x_0's square sums (at init_ss). piece_words: the words of one 64-value piece, 64 (a value
    a word: its fp32 and its 32-bit tag) or 32 (`packed`: two values a word, `pack`).
    init_down_tag: None (the host's words are an input, all tagged tag(-1, epoch)) or 0
    (`kept_layout`: they lie in the kernel's state after the LL words, the down pieces zeros
    never written, which the readers take as they are)."""

    offsets: dict
    layer_words: int
    init_down: int
    init_H: int
    init_words: int
    init_ss: int
    piece_words: int = T
    init_down_tag: int | None = None

    @property
    def packed(self) -> bool:
        return self.piece_words != T


def pack(values, tag):
    """A packed LL word of two fp32 values, as int32 pairs [..., 2] (lo, hi): bits 0-15 the
    tag, 16-39 and 40-63 each value's fp32 bits rounded to their top 24 (sign, exponent and
    15 mantissa bits: 2^-16 relative), what `words.ll_store_rows(packed=True)` stores and its
    readers (`words.gather`) unpack. values [..., 2] fp32, tag < 2^16."""
    bits = lax.bitcast_convert_type(jnp.asarray(values, jnp.float32), jnp.uint32)
    top = (bits + 0x80) >> 8  # round to nearest on the magnitude
    a, b = top[..., 0], top[..., 1]
    lo = jnp.asarray(tag, jnp.uint32) | (a << 16)
    hi = (a >> 16) | (b << 8)
    return lax.bitcast_convert_type(jnp.stack([lo, hi], axis=-1), jnp.int32)


def layout(prods, D: int, attention: bool = False, packed: bool = False, att_splits: int = 1) -> Layout:
    """The word layout; packed: pieces two values a word (`Layout.piece_words` 32).
    att_splits R > 1 (each head's positions split over R attention blocks,
    `attention.split_tiles`): "att" holds every split's normalised output, chunk c's split
    s at words (c R + s) 64 + col, and "lse" its log2-sum-exp, the same at each column."""
    piece = T // 2 if packed else T
    offsets, w = {}, 0
    for p in prods:
        offsets[p.name] = w
        w += p.tiles * p.split.sk * piece
    att = (("att", D),) if att_splits == 1 else (("att", att_splits * D), ("lse", att_splits * D))
    for name, n in (("X", D), ("H", D), ("Xss", D // SS), ("Hss", D // SS)) + (att if attention else ()):
        offsets[name] = w
        w += n
    down = prods[3]
    init_H = down.tiles * down.split.sk * piece
    return Layout(offsets, w, 0, init_H, init_H + D + D // SS, init_H + D, piece)


REGIONS = 2  # layer l's words live in region l % REGIONS, overwritten two layers later
EPOCHS = 256  # the calls a kept state's tags tell apart (`tag`'s epoch, bits 8-15)
MAX_LAYERS = 254  # layer l's tags keep l + 2 below bit 8


def kept_layout(lay: Layout) -> Layout:
    """`lay` with the host's words in the kernel's kept state, right after the LL words of the
    two regions (`chain_mgpu(embed=...)`: the kernel writes x_0 and its square sums there each
    call; the down pieces stay the zeros the state was made with, tag 0)."""
    at = REGIONS * lay.layer_words
    return dataclasses.replace(lay, init_down=at + lay.init_down, init_H=at + lay.init_H,
                               init_ss=at + lay.init_ss, init_down_tag=0)


def state_words(lay: Layout, greedy: int = 0) -> int:
    """int32 words of a kept state (`chain_mgpu(state=...)`): the LL words of the regions,
    the host's words where `kept_layout` puts them there, two LL words for each of `greedy`
    head blocks' choices (`greedy_word`), then the epoch and its count."""
    return (2 * REGIONS * lay.layer_words + (2 * lay.init_words if lay.init_down_tag is not None else 0)
            + 4 * greedy + 2)


def greedy_word(lay: Layout) -> int:
    """First LL word of the head blocks' choices in a kept state with the host's words
    (`kept_layout`): block i's value and row at words 2 i, 2 i + 1 (`greedy.publish`)."""
    return lay.init_down + lay.init_words


def tag(l, epoch=0):
    """The tag of layer l's words (l, epoch ints or traced): l + 2 + 256 epoch, so that the
    host's words, which stand in for layer -1, carry 1 + 256 epoch and a word left from layer
    l - 2 in the same region (or the zeroed memory) never passes for layer l's. Two regions
    are enough: every write of layer l + 2 depends, through the attention of every head, on
    all of x_{l+1}, which no block computes before it has read all of its layer-l words.

    epoch (< EPOCHS; 0 where the words are zeroed each call): the call's, where the words
    outlive it (`chain_mgpu(state=...)`): a word left from the call before carries the
    other epoch, and every word a call reads it also writes (once a layer of its region), so
    none from two calls back is left."""
    t = l + 2
    return t if isinstance(epoch, int) and epoch == 0 else t + 256 * epoch  # no add of 0 in the PTX


def region(l, lay: Layout):
    """First word of layer l's region."""
    return (l % REGIONS) * lay.layer_words


def init_words(x0_D, prods, lay: Layout, epoch=0):
    """The host-written words for layer -1, as int32 pairs [init_words, 2]: zero down pieces
    (packed as the layout says), x_0 and its square sums, each tagged tag(-1, epoch) (1 at
    epoch 0)."""
    def plain(vals):  # a value a word: its fp32 bits, then the tag
        bits = lax.bitcast_convert_type(vals, jnp.int32)
        return jnp.stack([bits, jnp.full_like(bits, tag(-1, epoch))], axis=-1)

    x0 = x0_D.astype(jnp.float32)
    if lay.packed:  # the down pieces: zeros, two a word or one
        down = pack(jnp.zeros((lay.init_H, 2), jnp.float32), tag(-1, epoch))
    else:
        down = plain(jnp.zeros((lay.init_H,), jnp.float32))
    return jnp.concatenate([down, plain(x0), plain((x0.reshape(-1, SS) ** 2).sum(axis=1))]).reshape(-1)


def piece_word(p: Product, l, t, gk, lay: Layout):
    """First LL word of layer l's piece of tile t of product p from chunk group gk."""
    return region(l, lay) + lay.offsets[p.name] + (t * p.split.sk + gk) * lay.piece_words


class Source(NamedTuple):
    """Words a product's input reads, one group (`input_spec`): for chunk c, the words
    base_word + c * stride + j * 64 + col for j < count (packed: j * 32 + col // 2, two
    values a word, `pack`), each written with `tag`. is_b: SwiGLU's up (summed apart from
    A's); init_ok: at layer 0 they are the host's words (`init_words`). count, stride, is_b
    and packed are static; base_word and tag ints or traced."""

    count: int
    stride: int
    is_b: bool
    base_word: object
    init_ok: bool
    tag: object
    packed: bool = False
    lse: bool = False  # the splits' log2-sum-exps: the values group's weights (`input_spec`)


def input_spec(name: str, l, gt, prods, lay: Layout, F: int, norms: bool = False,
               attention: bool = False, sums: bool = False, epoch=0, att_splits: int = 1):
    """Where product `name` of layer l reads its input chunk c (block in tile group gt):
    (groups, dense, norm). groups: [`Source`]: a product's pieces (count sk, one a chunk
    group, stride sk pieces) or a dense vector (count 1, stride 64). dense: where (and with which tag) the readers of tile group 0 write the input's sum (A's)
    as a dense vector, {} for none. norm (with
    norms): (base_word, init_ok, tag) of the dense vector whose RMSNorm factor scales this input
    (x_l for the q|k|v output that o reads, h_l for gate|up's), else None. attention: o
    reads the attention phase's output (`attention_spec` says what that phase reads). sums:
    the norm's readers read the vector's square sums (D / SS words: Xss, Hss) instead of the
    vector, and the dense vector's writers write them (dense's `dense_ss`). epoch: the
    call's (`tag`). att_splits R > 1: o reads the R splits' outputs of its chunk (count R)
    and their log2-sum-exps (`Source.lse`), and takes their weighted mean: sum_s 2^(lse_s -
    M) o_s / sum_s 2^(lse_s - M), M the largest. Works on ints (tests) and traced values
    (the kernel)."""
    qkv, o, gu, down = prods
    P, packed = lay.piece_words, lay.packed  # words a piece, and whether two values share one

    def base(layer, name):
        return region(layer, lay) + lay.offsets[name]

    tg = lambda layer: tag(layer, epoch)  # noqa: E731
    first = l == 0
    x_l = jnp.where(first, lay.init_H, base(l, "X"))  # X_0 is the host's x_0 (tag 1)
    x_ss = jnp.where(first, lay.init_ss, base(l, "Xss"))  # and so are its square sums
    x_tag = jnp.where(first, tg(-1), tg(l))

    def ss(vector):  # the dense writers' square sums, with sums
        return dict(dense_ss=base(l, vector + "ss")) if sums else {}

    def pieces(prod, base_word, tag_, init_ok=False, is_b=False):  # prod's sk pieces a chunk
        sk = prod.split.sk
        return Source(sk, P * sk, is_b, base_word, init_ok, tag_, packed)

    def vector(base_word, tag_, init_ok=False):  # a dense vector, a value a word
        return Source(1, 64, False, base_word, init_ok, tag_)

    if name == "qkv":  # x_l = H_{l-1} + the previous down's pieces; X_l dense
        down_word = jnp.where(first, lay.init_down, base(l - 1, "down"))
        down_tag = tg(l - 1) if lay.init_down_tag is None else jnp.where(first, lay.init_down_tag, tg(l - 1))
        groups = [pieces(down, down_word, down_tag, True),
                  vector(jnp.where(first, lay.init_H, base(l - 1, "H")), tg(l - 1), True)]
        return groups, dict(dense_base=base(l, "X"), dense_on=(gt == 0) & (l > 0), dense_tag=tg(l), **ss("X")), None
    if name == "o" and attention and att_splits > 1:  # each split's output, merged by the reader
        R = att_splits
        return [Source(R, 64 * R, False, base(l, "att"), False, tg(l)),
                Source(R, 64 * R, False, base(l, "lse"), False, tg(l), lse=True)], {}, None
    if name == "o" and attention:  # the attention phase's output, dense
        return [vector(base(l, "att"), tg(l))], {}, None
    if name in ("o", "att"):  # qkv's pieces (times x_l's RMSNorm factor): o without
        # attention reads the q part; the attention phase reads a head's q, k and v
        norm = (x_ss if sums else x_l, True, x_tag) if norms else None
        return [pieces(qkv, base(l, "qkv"), tg(l))], {}, norm
    if name == "gu":  # h_l = X_l + o's pieces; H_l dense
        groups = [pieces(o, base(l, "o"), tg(l)), vector(x_l, x_tag, True)]
        return groups, dict(dense_base=base(l, "H"), dense_on=gt == 0, dense_tag=tg(l), **ss("H")), None
    if name == "down":  # silu(gate) * up from gate|up's pieces (times h_l's RMSNorm factor)
        gate = pieces(gu, base(l, "gu"), tg(l))  # up's pieces follow gate's F / T tiles
        norm = (base(l, "Hss" if sums else "H"), False, tg(l)) if norms else None
        return [gate, gate._replace(is_b=True, base_word=gate.base_word + (F // T) * gate.stride)], {}, norm
    if name in ("final", "head"):  # x_L = H_{L-1} + the last down's pieces (l = L - 1): the
        # kernel's output and the output layer's input
        return [pieces(down, base(l, "down"), tg(l)), vector(base(l, "H"), tg(l))], {}, None
    raise ValueError(f"input_spec: no product {name!r}")
