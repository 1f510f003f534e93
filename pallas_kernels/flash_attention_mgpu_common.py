"""Pieces shared by the Mosaic GPU FlashAttention kernels (`flash_attention_mgpu_fwd.py`,
`flash_attention_mgpu_bwd.py`): their tile sizes, the static config of one call, and the
helpers of their kernel bodies (masks, causal tile ranges, the producer's drain, the refs'
layout).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import COL, SMEM_LIMIT, WGMMA, smem_bytes

COMPUTE_WGS = 2  # consumer warpgroups per block; warpgroup 2 is the producer
CONSUMER_REGS = 232  # registers a consumer warpgroup's threads get by default
FUSED_BWD_REGS = 240  # the fused backward's consumers (spills 120 B instead of 184 at 232)
LAUNCH_REGS = 168 * (COMPUTE_WGS + 1) * 128  # what a block launches with (168 a thread)
MIN_PRODUCER_REGS = 24  # the fewest registers setmaxnreg can leave a warpgroup
# the most a consumer may ask for, leaving the producer MIN_PRODUCER_REGS: 240
MAX_CONSUMER_REGS = (LAUNCH_REGS - 128 * MIN_PRODUCER_REGS) // (128 * COMPUTE_WGS) // 8 * 8
FUSED_BWD_MIN_KV = 8192  # keys from which the fused backward is the default (head dim 128)
PERSISTENT_DQ_MAX_KV = 2048  # keys up to which the dQ kernel is persistent by default
DS_IN_HBM_MAX_BYTES = 4 << 30  # the largest dS^T buffer `ds_in_hbm` takes by default
SMEM_RESERVE = 8192  # bytes of a block's shared memory left for barriers and alignment


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tiles of the three Mosaic GPU kernels (rows per consumer warpgroup)."""

    block_q: int = 64  # forward: query rows per consumer warpgroup (a block holds two)
    block_kv: int = 128  # forward: key rows per pipeline step
    stages: int = 2  # forward: K/V tiles in flight
    block_q_dq: int = 64  # dQ kernel: query rows per consumer warpgroup
    block_kv_dq: int = 64  # dQ kernel: key rows per pipeline step
    block_q_dkv: int = 64  # dK/dV kernel: query rows per pipeline step
    block_kv_dkv: int = 64  # dK/dV kernel: key rows per consumer warpgroup
    stages_bwd: int = 2  # backward kernels: tiles in flight
    persistent: bool | None = None  # forward: one block per SM looping over query tiles (the
    # next tile's Q load and K/V stream under this tile's epilogue; with a causal mask over
    # pairs of one head's tiles); None: where it fits (causal: D 128, pairs; `resolve_persistent`)
    persistent_dq: bool | None = None  # the dQ kernel on the same persistent schedule; None:
    # head dim 128 up to PERSISTENT_DQ_MAX_KV keys, where its out tiles fit and (causal) pair
    persistent_dkv: bool | None = None  # the dK/dV kernel (two kernels' form) over key blocks
    # on that schedule (causal: pairs of key blocks); None: off (it measured slower)
    named_schedule: bool | None = None  # forward: the consumers' ping-pong on two hardware
    # named barriers (bar.arrive / bar.sync) instead of an mbarrier; None: when compiling
    manual_barriers_bwd: bool = True  # backward kernels: only their own barriers (no warpgroup
    # barrier per shared-memory load and TMA issue); False: Pallas's automatic ones
    fused_bwd: bool | None = None  # backward: one kernel for dQ, dK, dV (5 tile matmuls, dQ
    # summed in fp32 by TMA reduce-add) instead of a dQ kernel and a dK/dV kernel (7); None:
    # where it measured faster on the H200 (`resolve_fused_bwd`)
    end_wait_reads: bool = True  # every kernel ends waiting only until its last TMA stores
    # have read shared memory (as CUTLASS's epilogues and jax's Hopper matmul do); False:
    # until their writes have landed (the two kernels measured 0-2% slower so, four samples)
    regs_bwd: int | None = None  # registers of a backward consumer warpgroup; the producer
    # gets what is left of the launch's 64,512 (232: 40, 240: 24, FlashAttention-3's split);
    # None: 240 in the fused backward (its consumers spill at 232), 232 in the two kernels
    dq_heads_major: bool = False  # fused backward: dQ summed in fp32 as [B, heads, T, D], a
    # (query tile, head) one contiguous block, instead of [B, T, heads, D] (rows 8 KiB apart)
    own_causal_steps: bool = True  # the two backward kernels under a causal mask: each consumer
    # computes only the steps its own rows see (the dQ kernel's first consumer skips the
    # block's last key tile, the dK/dV kernel's second its first query tile) and waits through
    # the rest of its block's ring; False: every consumer computes every step of its block
    delta_in_dq: bool = True  # the two backward kernels: the dQ kernel loads O's rows beside
    # dO's and computes delta = rowsum(dO * O) for both kernels; False: an XLA pass before them
    ds_in_hbm: bool | None = None  # the backward as the dK/dV kernel then dQ = dS K: the dK/dV
    # kernel also stores each dS^T tile it computes (bf16) into a [B, heads, keys, queries]
    # buffer in global memory, which a memory-bound dQ kernel reads (6 tile matmuls a pair
    # instead of 7, S and dP computed once; delta by XLA). Costs keys x queries x 2 bytes a
    # head of transient memory (3.2 GB at the 1b step's 24 x 2k x 16 heads): O(S^2), unlike
    # FlashAttention. None: when compiling at head dim 128 and that buffer is at most
    # DS_IN_HBM_MAX_BYTES (`resolve_ds_in_hbm`)
    stages_dq_ds: int = 4  # its dQ kernel: K and dS tiles in flight

    def __post_init__(self):
        if self.fused_bwd and self.ds_in_hbm:
            raise ValueError("MosaicBlockSizes: fused_bwd=True and ds_in_hbm=True are two forms of "
                             "the backward; set one of them.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "regs_bwd":
                if value is not None and (value % 8 or not CONSUMER_REGS <= value <= MAX_CONSUMER_REGS):
                    raise ValueError(f"MosaicBlockSizes.regs_bwd={value}: use a multiple of 8 in "
                                     f"[{CONSUMER_REGS}, {MAX_CONSUMER_REGS}] (the producer keeps "
                                     f">= {MIN_PRODUCER_REGS}).")
            elif f.name in ("manual_barriers_bwd", "end_wait_reads", "dq_heads_major",
                            "own_causal_steps", "delta_in_dq"):
                if not isinstance(value, bool):
                    raise ValueError(f"MosaicBlockSizes.{f.name}={value!r}: use True or False.")
            elif f.name in ("persistent", "persistent_dq", "persistent_dkv", "named_schedule",
                            "fused_bwd", "ds_in_hbm"):
                if value not in (None, True, False):
                    raise ValueError(f"MosaicBlockSizes.{f.name}={value!r}: use True, False or None.")
            elif f.name.startswith("stages"):
                if value < 1:
                    raise ValueError(f"MosaicBlockSizes.{f.name}={value}: use >= 1.")
            elif value % 64:
                raise ValueError(f"MosaicBlockSizes.{f.name}={value}: use a multiple of 64 "
                                 "(wgmma rows and 128-byte swizzled tiles).")

    @property
    def consumer_regs_bwd(self) -> int:
        """The backward consumers' registers (`regs_bwd`, resolved for this form)."""
        if self.regs_bwd is not None:
            return self.regs_bwd
        return FUSED_BWD_REGS if self.fused_bwd else CONSUMER_REGS

    @classmethod
    def for_head_dim(cls, head_dim: int) -> MosaicBlockSizes:
        """Defaults: 64-row consumers, 128-key forward tiles, as FlashAttention-3 uses."""
        if head_dim <= 64:
            return cls(stages=3)
        return cls()

    def resolve_persistent(self, head_dim: int, regs: bool, causal: bool, q_len: int) -> bool:
        """The forward's grid: as asked, or (None) persistent when its own O tiles fit in
        shared memory beside P's staging tiles (regs=False) and, with a causal mask, at head
        dim 128 where the query tiles pair up (an even number a head: `TileSchedule`). Causal
        pairs measured faster than one block per tile on the H200: forward +4% at 2k x batch
        24, +13% at 2k x batch 8, +7% at 4k, +6% at 4k GQA, +1% at 16k (benchmarks/attention.md)."""
        if self.persistent is not None:
            return self.persistent
        if causal and (head_dim != 128 or not _pairs(q_len, self.block_q)):
            return False  # causal pairs: timed at head dim 128 only
        return self._need(head_dim, regs, True)["forward"] <= SMEM_LIMIT - SMEM_RESERVE

    def resolve_persistent_dq(self, head_dim: int, regs: bool, causal: bool, q_len: int,
                              kv_len: int) -> bool:
        """The dQ kernel's grid: as asked, or (None) persistent at head dim 128 up to
        PERSISTENT_DQ_MAX_KV keys (short tiles, where a tile's prologue and epilogue weigh
        most), where its dQ out tiles fit in shared memory and, with a causal mask, its query
        tiles pair up. H200, forward+backward: +5% at 2k causal x batch 24, +2% at x 8; at 4k
        -1.5% (no mask), -1.7% (causal), 0% (causal GQA), one run: benchmarks/attention.md."""
        fits = self._need(head_dim, regs, False, True)["dq"] <= SMEM_LIMIT - SMEM_RESERVE
        if self.persistent_dq is not None:
            if self.persistent_dq and not fits:
                raise ValueError("MosaicBlockSizes.persistent_dq=True: the dQ kernel's tiles and "
                                 "its dQ out tiles do not fit shared memory; shrink block_q_dq.")
            return self.persistent_dq
        if head_dim != 128 or kv_len > PERSISTENT_DQ_MAX_KV:  # timed at head dim 128 only
            return False
        return fits and not (causal and not _pairs(q_len, self.block_q_dq))

    def resolve_persistent_dkv(self, head_dim: int, regs: bool) -> bool:
        """The dK/dV kernel's grid: as asked, or (None) one block per key block: persistent it
        measured slower at 2k causal on the H200 (-5.5% forward+backward at batch 24, -2% at
        8; benchmarks/attention.md). The fused backward (`fused_bwd` resolved) always keeps one
        block per key block."""
        if self.fused_bwd:
            return False
        fits = self._need(head_dim, regs, False, persistent_dkv=True)["dkv"] <= SMEM_LIMIT - SMEM_RESERVE
        if self.persistent_dkv is not None:
            if self.persistent_dkv and not fits:
                raise ValueError("MosaicBlockSizes.persistent_dkv=True: the dK/dV kernel's tiles and "
                                 "its out tiles do not fit shared memory; shrink block_kv_dkv or stages_bwd.")
            return self.persistent_dkv
        return False  # measured slower on the H200 (2k causal x 24: -5.5%, x 8: -2%)

    def pads(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """(q_pad, kv_pad): the lengths padded to whole tiles of all three kernels (and of
        `ds_in_hbm`'s dQ kernel, 2 x block_q_dkv rows a tile, unless it is off)."""
        tile_q = math.lcm(COMPUTE_WGS * self.block_q, COMPUTE_WGS * self.block_q_dq,
                          self.block_q_dkv * (1 if self.ds_in_hbm is False else COMPUTE_WGS))
        tile_kv = math.lcm(self.block_kv, self.block_kv_dq, COMPUTE_WGS * self.block_kv_dkv)
        return -(-q_len // tile_q) * tile_q, -(-kv_len // tile_kv) * tile_kv

    def resolve_ds_in_hbm(self, head_dim: int, regs: bool, batch_heads: int, q_len: int,
                          kv_len: int, itemsize: int = 2) -> bool:
        """The backward through dS in global memory: as asked, or (None) when compiling at
        head dim 128 (where it was timed) unless `fused_bwd` is asked for, if its dS^T buffer
        (batch x heads x kv_pad x q_pad elements) is at most DS_IN_HBM_MAX_BYTES. H200, the
        1b step's attention (2k causal, batch 24, 3.2 GB): 2.85 against 3.10-3.19 ms of kernel
        time a forward+backward, the 1b step +1.0-1.5% (benchmarks/attention.md)."""
        if self.ds_in_hbm is not None:
            return self.ds_in_hbm
        if not regs or head_dim != 128 or self.fused_bwd:
            return False
        q_pad, kv_pad = self.pads(q_len, kv_len)
        return batch_heads * q_pad * kv_pad * itemsize <= DS_IN_HBM_MAX_BYTES

    def resolve_fused_bwd(self, head_dim: int, kv_len: int, regs: bool = True) -> bool:
        """The backward's form: as asked, or (None) fused at head dim 128 from 8k keys on, where
        it measured faster than the two kernels on the H200 (with its 240-register consumers:
        +6% at 8k, +4-10% at 16k, causal and not; at 2k and 4k 5-16% slower:
        benchmarks/attention.md), if its shared memory fits these tiles."""
        if self.fused_bwd is not None:
            return self.fused_bwd
        if self.ds_in_hbm:
            return False
        fits = self._need(head_dim, regs, False)["fused backward"] <= SMEM_LIMIT - SMEM_RESERVE
        return head_dim == 128 and kv_len >= FUSED_BWD_MIN_KV and fits

    def _need(self, head_dim: int, regs: bool, persistent: bool,
              persistent_dq: bool = False, persistent_dkv: bool = False) -> dict[str, int]:
        d, w, h = head_dim, COMPUTE_WGS, jnp.float16
        staged = lambda shape: [] if regs else [(shape, h)]
        return {
            # Q tiles, and O tiles of their own in the persistent grid (else O goes out via Q's)
            "forward": smem_bytes((((2 if persistent else 1) * w, self.block_q, d), h),
                                  ((2 * self.stages, self.block_kv, d), h),
                                  ((w, self.block_q), jnp.float32),
                                  *staged((w, self.block_q, self.block_kv))),
            # Q, dO (and O: delta_in_dq) tiles, and dQ tiles of their own in the persistent grid
            "dq": smem_bytes((((2 + self.delta_in_dq + persistent_dq) * w, self.block_q_dq, d), h),
                             *([((w, self.block_q_dq), jnp.float32)] if self.delta_in_dq else []),
                             ((2 * self.stages_bwd, self.block_kv_dq, d), h),
                             *staged((w, self.block_q_dq, self.block_kv_dq))),
            # K and V tiles, and dK and dV tiles of their own in the persistent grid
            "dkv": smem_bytes((((4 if persistent_dkv else 2) * w, self.block_kv_dkv, d), h),
                              ((2 * self.stages_bwd, self.block_q_dkv, d), h),
                              ((2 * self.stages_bwd, self.block_q_dkv), jnp.float32),
                              *staged((w, self.block_kv_dkv, self.block_q_dkv)),
                              # ds_in_hbm: dS^T tiles on their way out, by step parity
                              *([((2 * w, self.block_kv_dkv, self.block_q_dkv), h)]
                                if self.ds_in_hbm else [])),
            # ds_in_hbm's dQ kernel: K and both consumers' dS^T tiles a stage, dQ tiles out
            "dq from dS": smem_bytes(((self.stages_dq_ds, self.block_kv_dkv, d), h),
                                     ((self.stages_dq_ds * w, self.block_kv_dkv, self.block_q_dkv), h),
                                     ((w, self.block_q_dkv, d), h)),
            "fused backward": smem_bytes(((2 * w, self.block_kv_dkv, d), h),
                                         ((2 * self.stages_bwd, self.block_q_dkv, d), h),
                                         ((2 * self.stages_bwd, self.block_q_dkv), jnp.float32),
                                         *staged((w, self.block_kv_dkv, self.block_q_dkv)),
                                         ((2 * w, self.block_kv_dkv, self.block_q_dkv), h),  # dS^T by step parity
                                         ((w, self.block_q_dkv, d // dq_parts(d)), jnp.float32)),
        }

    def check_smem(self, head_dim: int, regs: bool, persistent: bool = False,
                   persistent_dq: bool = False, persistent_dkv: bool = False):
        """Raises if a kernel's shared memory would exceed what one sm90 block has
        (bf16/fp16 tiles; regs=False adds the P / dS staging buffers)."""
        skip = ("dq", "dkv") if self.fused_bwd else ("fused backward",)
        skip += ("dq",) if self.ds_in_hbm else ("dq from dS",)
        for name, n in self._need(head_dim, regs, persistent, persistent_dq, persistent_dkv).items():
            if name in skip:
                continue
            if n > SMEM_LIMIT - SMEM_RESERVE:  # barriers and alignment take a few KiB more
                raise ValueError(f"MosaicBlockSizes: the {name} kernel needs {n} bytes of shared "
                                 f"memory at head_dim={head_dim}; shrink its tiles or stages.")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Everything static about one call (hashable: it keys the compile cache)."""

    causal: bool
    sm_scale: float
    blocks: MosaicBlockSizes
    q_len: int
    kv_len: int
    groups: int  # query heads per kv head
    segments: bool
    regs: bool  # P and dS from registers (GPU); False stages them in shared memory
    interpret: bool
    persistent: bool = False  # the forward runs one block per SM over the query tiles
    persistent_dq: bool = False  # so does the dQ kernel
    persistent_dkv: bool = False  # and the dK/dV kernel over key blocks (not the fused one)
    sms: int = 132  # blocks of the persistent grids: one per streaming multiprocessor

    @property
    def delta_in_dq(self) -> bool:
        """Whether the dQ kernel computes delta (`MosaicBlockSizes.delta_in_dq`; the two-kernel
        backward only: the fused one has no dQ kernel, ds_in_hbm's runs after the dK/dV one)."""
        return self.blocks.delta_in_dq and not self.blocks.fused_bwd and not self.blocks.ds_in_hbm

    @property
    def named_schedule(self) -> bool:
        """Whether the forward consumers alternate through hardware named barriers."""
        n = self.blocks.named_schedule
        if n and self.interpret:
            raise ValueError("MosaicBlockSizes.named_schedule=True needs a GPU (the interpreter "
                             "runs no inline PTX); use None or False with interpret=True.")
        return (not self.interpret) if n is None else n

    @property
    def q_pad(self) -> int:
        return self.blocks.pads(self.q_len, self.kv_len)[0]

    @property
    def kv_pad(self) -> int:
        return self.blocks.pads(self.q_len, self.kv_len)[1]


def _pairs(length: int, rows: int) -> bool:
    """Whether `length` rows make an even number of tiles of COMPUTE_WGS x `rows` (causal
    pairs for `TileSchedule`)."""
    return -(-length // (COMPUTE_WGS * rows)) % 2 == 0


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """Which (batch, head, tile) each block runs: query tiles (forward, dQ) or key blocks (dK/dV).

    One block per tile (`persistent` False): block t runs flat tile t of (batch, head, tile)
    order. Persistent: `blocks` = min(SMs, units) blocks, block blk running units blk,
    blk + blocks, ... so its next tile's loads can run under this tile's epilogue. A unit is
    a tile, or with a causal mask a pair of one head's tiles, n_t - 1 - u then u, whose key
    steps sum to the same (any q offset: the steps grow linearly with the tile), so equal
    shares of units are equal shares of work; round-robin over single causal tiles is not (132
    blocks over 16 tiles a head: some blocks average 10 steps a tile, others 7). Causal tiles
    run longest first either way (a better tail)."""

    batch: int
    heads: int
    n_t: int  # tiles a (batch, head)
    causal: bool
    persistent: bool
    sms: int
    longest_high: bool = True  # causal: the highest tile index has the most steps (query
    # tiles); False: the lowest (the dK/dV kernel's key blocks)

    @property
    def paired(self) -> bool:
        return self.persistent and self.causal and self.n_t % 2 == 0

    @property
    def n_units(self) -> int:
        return self.batch * self.heads * self.n_t // (2 if self.paired else 1)

    @property
    def blocks(self) -> int:
        return min(self.sms, self.n_units) if self.persistent else self.batch * self.heads * self.n_t

    @property
    def grid_name(self) -> str:
        return "sm" if self.persistent else "t"

    def n_mine(self, blk):
        """How many tiles block blk runs."""
        if not self.persistent:
            return 1
        return (2 if self.paired else 1) * (lax.div(self.n_units - 1 - blk, self.blocks) + 1)

    def tile_at(self, blk, i):
        """(batch, head, tile) of block blk's i-th tile."""
        n, n_t = self.heads, self.n_t
        if self.paired:
            u = blk + lax.div(i, 2) * self.blocks
            bh, kk = lax.div(u, n_t // 2), lax.rem(u, n_t // 2)
            first = lax.rem(i, 2) == 0  # the pair's longer tile first
            qi = jnp.where(first == self.longest_high, n_t - 1 - kk, kk)
            return lax.div(bh, n), lax.rem(bh, n), qi
        t = blk + i * self.blocks if self.persistent else blk
        bi, rest = lax.div(t, n * n_t), lax.rem(t, n * n_t)
        h, qi = lax.div(rest, n_t), lax.rem(rest, n_t)
        return bi, h, (n_t - 1 - qi) if self.causal and self.longest_high else qi

    def loop(self, blk, body):
        """body(i, (batch, head, tile), key steps run before it) -> the tile's key steps, over
        block blk's tiles; returns the block's key steps (the ring's position)."""
        def one(i, done):
            return done + body(i, self.tile_at(blk, i), done)
        return lax.fori_loop(0, self.n_mine(blk), one, jnp.int32(0))


def dq_parts(head_dim: int) -> int:
    """Column parts of the fused backward's dQ tile a step: one per consumer when a part is
    at least 64 columns (one 128-byte swizzled tile of bf16 keys), else one."""
    return COMPUTE_WGS if head_dim // COMPUTE_WGS >= 64 else 1


def bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def cdiv(a, b: int):
    return lax.div(a + (b - 1), b)


def kv_steps(cfg: MosaicConfig, pos_first, pos_last, bk: int, *, length: bool = True):
    """Key tiles [0, n_full) are visible to every query in [pos_first, pos_last] and need no
    mask; [n_full, n_end) need one; tiles from n_end on are skipped (causal). length=False:
    the ragged last tile needs no mask (its padded keys are zero and add nothing to dQ)."""
    n_end = -(-cfg.kv_len // bk)  # Python ints stay literals
    n_full = cfg.kv_len // bk if length else n_end
    if cfg.causal:
        n_end = jnp.minimum(n_end, cdiv(pos_last + 1, bk))
        n_full = jnp.minimum(n_full, lax.div(pos_first + 1, bk))
    if cfg.segments:
        n_full = 0
    if cfg.causal:
        n_full = jnp.minimum(n_full, n_end)
    return n_full, n_end


def needs_mask(cfg: MosaicConfig, bk: int) -> bool:
    return cfg.causal or cfg.segments or cfg.kv_len % bk != 0


def visible(cfg: MosaicConfig, q_pos, k_pos, q_seg, kv_seg, *, length: bool):
    """(query, key) pairs that may attend; all operands broadcast to the tile shape."""
    ok = None
    conj = lambda a, b: b if a is None else jnp.logical_and(a, b)
    if cfg.causal:
        ok = conj(ok, k_pos <= q_pos)
    if length:
        ok = conj(ok, k_pos < cfg.kv_len)
    if cfg.segments:
        ok = conj(ok, q_seg == kv_seg)
    return ok


def mask_rows_by_keys(cfg: MosaicConfig, s, q_pos0, k_pos0, q_seg, kvseg_ref, bi, *,
                      length: bool):
    """s [query rows, keys] (a wgmma tile) with -inf where a query may not attend: rows from
    query position q_pos0 (q_seg: their segment ids, ROW layout, or None), columns from key
    position k_pos0 (their segment ids read from kvseg_ref[bi] when cfg.segments)."""
    kv_seg = None
    if cfg.segments:
        kv_seg = bcast_cols(plgpu.load(kvseg_ref.at[bi, pl.ds(k_pos0, s.shape[1])], layout=COL,
                                       optimized=False), s.shape)
    ok = visible(cfg, q_pos0 + iota(s.shape, 0), k_pos0 + iota(s.shape, 1),
                 None if q_seg is None else bcast_rows(q_seg, s.shape), kv_seg, length=length)
    return jnp.where(ok, s, -jnp.inf)


def pass_steps(lo, hi, slot_of, filled, free):
    """A consumer's ring steps [lo, hi) that its own rows do not see (causal): it waits for
    each slot's tiles (keeping its barrier phases in step with the ring) and frees the slot
    for the producer, computing nothing."""
    @pl.loop(lo, hi)
    def _(j):
        slot = slot_of(j)
        for bar in filled:
            plgpu.barrier_wait(bar.at[slot])
        plgpu.barrier_arrive(free.at[slot])


def drain(n_steps, stages: int, *free_barriers):
    """The producer waits until the consumers release the last slots it filled, so that
    every barrier phase is observed before the block exits (jax 0.11.2's interpreter checks
    this at deallocation; on the GPU it only delays the producer's exit)."""
    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _(j):
        for bar in free_barriers:
            plgpu.barrier_wait(bar.at[lax.rem(j, stages)])


def unpack(refs, cfg: MosaicConfig, n_in: int):
    """Splits a kernel's refs into (qoff, inputs..., qseg, kvseg) and the rest."""
    refs = list(refs)
    qoff, ins = refs[0], refs[1:n_in]
    rest = refs[n_in:]
    if cfg.segments:
        qseg, kvseg, rest = rest[0], rest[1], rest[2:]
    else:
        qseg = kvseg = None
    return qoff, ins, qseg, kvseg, rest


def with_segments(cfg: MosaicConfig, arrays: list, q_seg, kv_seg) -> list:
    """A kernel's inputs in the order `unpack` reads them: the segment ids last, if any."""
    return arrays + ([q_seg, kv_seg] if cfg.segments else [])


def producer_regs(consumer_regs: int) -> int:
    """The producer warpgroup's registers beside two consumers of `consumer_regs` (232: 40).
    setmaxnreg can only hand out what the launch allocated: asking for more hangs the block."""
    return (LAUNCH_REGS - COMPUTE_WGS * 128 * consumer_regs) // 128 // 8 * 8


def consumers(wg, regs: int = CONSUMER_REGS):
    """Runs the decorated body on the consumer warpgroups, raised to `regs` registers."""
    def run(body):
        @pl.when(wg < COMPUTE_WGS)
        def _():
            plgpu.set_max_registers(regs, action="increase")
            body()
    return run


def producer(wg, consumer_regs: int = CONSUMER_REGS):
    """Runs the decorated body on the producer warpgroup, cut to what the consumers leave."""
    def run(body):
        @pl.when(wg == COMPUTE_WGS)
        def _():
            plgpu.set_max_registers(producer_regs(consumer_regs), action="decrease")
            body()
    return run


def end_wait(cfg: MosaicConfig):
    """A kernel's last wait for its TMA stores: until they have read shared memory
    (`end_wait_reads`, enough before the block exits) or until they have landed."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.blocks.end_wait_reads)


def own_tiles(pairs, wg, row0, n_rows: int, bi, head, bar):
    """A consumer's own `n_rows` rows from `row0` of each (global ref, shared tiles) pair,
    copied into its shared tile with the copies arriving on bar[wg]: (rows, tiles)."""
    rows = pl.ds(row0, n_rows)
    tiles = [smem.at[wg] for _, smem in pairs]
    for (ref, _), tile in zip(pairs, tiles, strict=True):
        plgpu.copy_gmem_to_smem(ref.at[bi, rows, head], tile, bar.at[wg])
    return rows, tiles


def own_tiles_at(order: TileSchedule, blk, i, pairs, wg, n_rows: int, bar):
    """`own_tiles` of block blk's i-th tile (of `order`): this consumer's `n_rows` rows of it
    (a tile is COMPUTE_WGS x n_rows rows) from each (global ref, shared tiles) pair."""
    bi, h, t = order.tile_at(blk, i)
    own_tiles(pairs, wg, t * (COMPUTE_WGS * n_rows) + wg * n_rows, n_rows, bi, h, bar)


def stream_tiles_kv(order: TileSchedule, blk, n_steps_of, k_ref, v_ref, k_smem, v_smem, k_bar,
                    v_bar, k_free, v_free, *, groups: int, bk: int, stages: int):
    """The producer of a query-tile kernel (forward, dQ): the visible K/V tiles of each of
    block blk's tiles (`n_steps_of(q tile)` of them) through one ring, then drained."""
    def feed(i, tile, done):
        bi, h, qi = tile
        n_steps = n_steps_of(qi)
        stream_kv(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, bi=bi,
                  kvh=lax.div(h, jnp.int32(groups)), n_steps=n_steps, bk=bk, stages=stages,
                  done=done)
        return n_steps

    drain(order.loop(blk, feed), stages, *((k_free,) if v_free is k_free else (k_free, v_free)))


def stream_kv(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, *, bi, kvh,
              n_steps, bk: int, stages: int, done=None):
    """The producer's ring: K/V tile j into slot (done + j) % stages once the consumers freed
    it (k_free and v_free may be one barrier). done=None: a block's only stream, drained
    here; else the ring carries on after `done` earlier steps and the caller drains."""
    base = 0 if done is None else done

    @pl.loop(0, n_steps)
    def _(j):
        slot = lax.rem(base + j, stages)
        rows = pl.ds(j * bk, bk)

        @pl.when(base + j >= stages)
        def _():
            plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kvh], k_smem.at[slot], k_bar.at[slot])
        if v_free is not k_free:
            @pl.when(base + j >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kvh], v_smem.at[slot], v_bar.at[slot])

    if done is None:
        drain(n_steps, stages, *((k_free,) if v_free is k_free else (k_free, v_free)))


def wgmma_from(acc, lhs, rhs, staged):
    """acc += lhs @ rhs on the tensor core, lhs from registers; with a shared tile `staged`
    (regs=False) lhs is written there first, for the interpreter."""
    if staged is None:
        plgpu.wgmma(acc, lhs, rhs)
    else:
        staged[...] = lhs
        plgpu.commit_smem()
        plgpu.wgmma(acc, staged, rhs)
