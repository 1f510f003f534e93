"""Shared pieces of the Mosaic GPU (Hopper) kernels: where they run, shared-memory tiles.

Both jax 0.11.2 and 0.12 expose the names used here under
`jax.experimental.pallas.mosaic_gpu`. On a host without an sm90 GPU the kernels run in
Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`), which simulates warpgroups,
barriers, TMA copies and wgmma on the CPU. Two constructs have no interpreter support in
either version: `pl.run_state` over a wgmma accumulator and wgmma with its left operand
in registers. Each kernel therefore has a `regs` switch: True (the GPU default) feeds
P / dS to the tensor core from registers; False stages them through shared memory, which
the interpreter runs (and which the GPU also runs, so both paths are tested there).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

# Layouts of a wgmma accumulator and of one value per accumulator row / column.
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm90
LOG2E = math.log2(math.e)  # softmax in base 2: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)


@functools.cache
def sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of the default GPU (132 on an H100/H200 SXM)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", None) or default)
    except RuntimeError:
        return default


@functools.cache
def on_sm90() -> bool:
    """True when the default device is a Hopper GPU (compute capability 9.x)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


_REF_ACCESS = "write" in {f.name for f in dataclasses.fields(plgpu.RefType)}


def read_ref(*transforms):
    """The `inline_mgpu` argument type of a ref its inline code only reads. From jax 0.12.1
    Pallas refuses a kernel whose code writes one of its input arrays (a ref argument's
    type says whether it writes, `plgpu.RefType(write=...)`, default True); jax 0.11.2 and
    0.12.0 have neither the field nor the check, and take every ref argument as read and
    written. The type changes no generated code."""
    return plgpu.RefType(*transforms, write=False) if _REF_ACCESS else plgpu.RefType(*transforms)


_RACES = {"detect": False}


@contextlib.contextmanager
def detecting_races():
    """Kernels traced for the interpreter inside this block check every shared-memory access
    for data races (slow: tests only; read the result with the interpreter's race state)."""
    before = _RACES["detect"]
    _RACES["detect"] = True
    try:
        yield
    finally:
        _RACES["detect"] = before


def interpret_params(interpret: bool):
    """`interpret=` argument of `plgpu.kernel`: the GPU interpreter, or compile."""
    return plgpu.InterpretGPUParams(detect_races=_RACES["detect"]) if interpret else None


def swizzle_for(row_bytes: int) -> int:
    """Largest TMA/wgmma swizzle (128, 64 or 32 bytes) that divides a tile row."""
    for swizzle in (128, 64, 32):
        if row_bytes % swizzle == 0:
            return swizzle
    raise ValueError(f"a tile row of {row_bytes} bytes is not a multiple of 32 bytes")


def tiled_smem(shape, dtype):
    """A shared-memory buffer in the tiled, swizzled layout that TMA and wgmma read."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle_for(shape[-1] * itemsize)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(tuple(shape), dtype, transforms=transforms)


def smem_bytes(*buffers) -> int:
    """Shared memory taken by buffers given as (shape, dtype), each rounded to 1 KiB."""
    total = 0
    for shape, dtype in buffers:
        n = jnp.dtype(dtype).itemsize
        for d in shape:
            n *= d
        total += -(-n // 1024) * 1024
    return total


def launch(kernel, args, *, out_type, scratch, grid, grid_names, num_threads: int,
           interpret: bool, manual_barriers: bool = False, name: str | None = None):
    """Runs `kernel` over `grid` with the settings every kernel here shares: its threads are
    warpgroups named "wg", math may be approximate (exp2 on the multi-function unit), and
    `interpret` picks Mosaic GPU's CPU interpreter.

    manual_barriers=True turns off the warpgroup barriers Pallas inserts around every
    shared-memory load/store and before every TMA issue (`unsafe_no_auto_barriers`), and the
    cross-warp reduction scratch (row reductions of a wgmma tile stay inside a warp). The
    kernel must then never read and write one shared region from the same thread without a
    `commit_smem()` (a fence plus a warpgroup barrier) in between.

    name: the kernel's name in a profile (`<name>_mosaic_gpu_kernel`; None: the body's
    `__name__`), so that profiles tell the kernels apart and class them by name."""
    params = (plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                   reduction_scratch_bytes=0)
              if manual_barriers else plgpu.CompilerParams(approx_math=True))
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=num_threads,
        thread_name="wg",
        kernel_name=name,
        compiler_params=params,
        interpret=interpret_params(interpret),
    )(*args)


def named_barrier(op: str, barrier_id, threads: int):
    """`bar.arrive` / `bar.sync` on a hardware named barrier of the block (ids 4-15: Mosaic GPU
    keeps 0 and one per warpgroup for itself): `threads` is everyone taking part, arriving
    or syncing. GPU only: the interpreter has no inline Mosaic GPU code."""
    if op not in ("arrive", "sync"):
        raise ValueError(f"named_barrier: op={op!r}; use 'arrive' or 'sync'.")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def bar(_, bid):
        mgpu.utils.inline_ptx(f"bar.{op} $0, {threads};", bid.registers[()], has_side_effects=True)

    bar(jnp.asarray(barrier_id, jnp.int32))


def fence(ptx: str):
    """Inline PTX fences with no operands, e.g. "fence.proxy.async.global;" before TMA reads
    of what other blocks wrote (GPU only: the interpreter has no inline Mosaic GPU code)."""
    @plgpu.inline_mgpu()
    def emit(_):
        mgpu.utils.inline_ptx(ptx, has_side_effects=True)

    emit()


# A spinning thread gives up after this many polls (each one L2 round trip, ~0.5-1 us: some
# seconds in all) and traps: a wait that can never end (a wrong word, a block that is not
# resident) becomes a CUDA error instead of a hung GPU.
SPIN_LIMIT = 1 << 24
SPIN_GUARD = f"add.u32 n, n, 1; setp.gt.u32 p, n, {SPIN_LIMIT}; @p trap;"


def warp_retry(pred: str, label: str) -> str:
    """PTX: the whole warp branches back to `label` if `pred` holds in any of its lanes (a
    vote, then a uniform branch). A poll loop that lanes leave one by one is divergent code
    to ptxas; in a kernel that also issues wgmma, ptxas then serialises every wgmma of the
    kernel (its warning C7520, "compiler-inserted WG.AR in divergent path"). The words a
    lane polls arrive at about the same time, so a warp that polls until all its lanes see
    theirs loses nothing."""
    return f"vote.sync.any.pred {pred}, {pred}, -1; @{pred} bra.uni {label};"

# One thread's poll of one flag: spin until the 32-bit word at base + 4 * index reads >= target.
_POLL = f"""{{
.reg .pred p;
.reg .u32 v;
.reg .u32 n;
.reg .u64 a;
mov.u32 n, 0;
mul.wide.u32 a, $1, 4;
add.u64 a, a, $0;
LAB_POLL:
ld.relaxed.gpu.global.u32 v, [a];
{SPIN_GUARD}
setp.lt.u32 p, v, $2;
@p bra LAB_POLL;
}}"""


def wait_flags(flags_ref, count: int, target, acquire: bool = True):
    """Returns once every one of flags[0..count) (a global semaphore array, e.g. one flag a
    block that only its block signals) reads >= target. The warpgroup's 128 threads poll
    the flags in parallel, each its own (ceil(count / 128) rounds), so a wait costs one
    round trip to L2 rather than one per flag, and no two blocks' signals meet on one word
    (a single grid-wide counter takes every block's atomic add in turn). Then a warpgroup
    barrier and (acquire=True) an acquire fence: reads after it see what the signallers
    released. GPU only (inline PTX)."""
    @plgpu.inline_mgpu(arg_types=(read_ref(), plgpu.Layout.WG_SPLAT))
    def poll(_, ref, tgt):
        i32 = ir.IntegerType.get_signless(32)
        base = mgpu.utils.memref_ptr(ref)
        lane = arith.remui(mgpu.utils.thread_idx(), mgpu.utils.c(128, i32))
        for off in range(0, count, 128):
            index = arith.minui(arith.addi(lane, mgpu.utils.c(off, i32)), mgpu.utils.c(count - 1, i32))
            mgpu.utils.inline_ptx(_POLL, base, index, tgt.registers[()], has_side_effects=True)
        mgpu.utils.warpgroup_barrier()
        if acquire:
            mgpu.utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)

    poll(flags_ref, jnp.asarray(target, jnp.int32))


def signal_relaxed(sem_ref, inc: int = 1):
    """One thread of the warpgroup adds `inc` to a global semaphore with a *relaxed* atomic:
    no release, so nothing written before it is ordered with it (a probe of what a signal
    costs without a fence; a kernel whose readers need data written before the signal must
    order it some other way). GPU only (inline PTX)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def signal(_, ref):
        i32 = ir.IntegerType.get_signless(32)
        pred = mgpu.utils.single_thread_predicate(mgpu.utils.ThreadSubset.WARPGROUP)
        mgpu.utils.inline_ptx("red.relaxed.gpu.global.add.u32 [$0], $1;", mgpu.utils.memref_ptr(ref),
                              mgpu.utils.c(inc, i32), predicate=pred, has_side_effects=True)

    signal(sem_ref)


def const_i32(v: int):
    """An int32 MLIR constant (inside `inline_mgpu` code)."""
    return mgpu.utils.c(v, ir.IntegerType.get_signless(32))


def lane():
    """This thread's index in its warpgroup (inside `inline_mgpu` code)."""
    return arith.remui(mgpu.utils.thread_idx(), const_i32(128))


def ptr32(ref):
    """A shared-memory ref's address as a 32-bit integer (inline PTX operand)."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(32), mgpu.utils.memref_ptr(ref))


def ptr64(ref):
    """A global-memory ref's address as a 64-bit integer (inline PTX operand)."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(64), mgpu.utils.memref_ptr(ref))


def gmem_address(base_i64, index_i32, scale: int):
    """The global-memory address base + scale * index as a 64-bit integer (an inline PTX
    operand): base a 64-bit address (`ptr64`), index an unsigned 32-bit element index."""
    i64 = ir.IntegerType.get_signless(64)
    return arith.addi(base_i64, arith.muli(arith.extui(i64, index_i32), mgpu.utils.c(scale, i64)))


def _word_address(base_ptr, index_i32, scale: int):
    """The integer address base + scale * index (global memory: 64-bit)."""
    return gmem_address(llvm.ptrtoint(ir.IntegerType.get_signless(64), base_ptr), index_i32, scale)


def _smem_address(ref, index_i32, scale: int = 4):
    """A shared-memory address (32-bit) of ref's element `index`."""
    return arith.addi(ptr32(ref), arith.muli(index_i32, const_i32(scale)))


def ll_store(ll_ref, src_smem, word: int | jax.Array, tag, then_barrier: bool = False):
    """Low-latency (LL) store, as NCCL's LL protocol: the first 64 threads each write one
    8-byte word {src_smem[i] (fp32 bits), tag} to ll_ref's 8-byte words word + i, with one
    relaxed 64-bit store (single-copy atomic: a reader sees the old word or the new, never
    half), so that no fence orders the data before a flag. ll_ref: a global semaphore array
    read as 8-byte words (zero at the kernel's start: `pl.get_global`), tag != 0. src_smem:
    [64] fp32 the warpgroup wrote before a `commit_smem()`. then_barrier: end in a warpgroup
    barrier (before src_smem is written again). GPU only (inline PTX)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                  plgpu.Layout.WG_SPLAT))
    def store(_, ll, src, w, t):
        ln = lane()
        addr = _word_address(mgpu.utils.memref_ptr(ll), arith.addi(w.registers[()], ln), 8)
        mgpu.utils.inline_ptx(
            "{ .reg .pred p; .reg .b32 v; .reg .b64 d; setp.lt.u32 p, $3, 64;"
            " @p ld.shared.b32 v, [$0]; @p mov.b64 d, {v, $2};"
            " @p st.relaxed.gpu.global.b64 [$1], d; }",
            _smem_address(src, arith.minui(ln, const_i32(63))), addr, t.registers[()], ln,
            has_side_effects=True)
        if then_barrier:
            mgpu.utils.warpgroup_barrier()

    store(ll_ref, src_smem, jnp.asarray(word, jnp.int32), jnp.asarray(tag, jnp.int32))


def ll_gather(ll_ref, dst_smem, words, tag):
    """dst_smem[i] = sum over w in `words` of the fp32 in LL word w + i (i < 64), each read
    once its tag reads `tag` (`ll_store`'s words). Every thread polls its column's words
    together, one round trip an attempt, with relaxed 64-bit loads: no fence. `words`: a
    static-length list of each source's first word (traced int32). Ends in a warpgroup
    barrier, so the warpgroup may read dst_smem after it. GPU only (inline PTX)."""
    n = len(words)
    regs = " ".join(f".reg .b64 d{k}; .reg .b32 v{k}; .reg .b32 t{k};" for k in range(n))
    loads = " ".join(f"ld.relaxed.gpu.global.b64 d{k}, [${k + 1}]; mov.b64 {{v{k}, t{k}}}, d{k};"
                     for k in range(n))
    checks = " ".join(f"setp.ne.b32 p, t{k}, ${n + 1}; or.pred bad, bad, p;" for k in range(n))
    sums = " ".join(f"mov.b32 g, v{k}; add.f32 f, f, g;" for k in range(n))
    ptx = (f"{{ .reg .pred p; .reg .pred bad; .reg .u32 n; .reg .f32 f; .reg .f32 g; {regs} mov.u32 n, 0;"
           f" LAB_LL: {loads} {SPIN_GUARD} mov.pred bad, 0; {checks} {warp_retry('bad', 'LAB_LL')}"
           f" mov.f32 f, 0f00000000; {sums} mov.f32 $0, f; }}")

    @plgpu.inline_mgpu(arg_types=(read_ref(), plgpu.RefType(), [plgpu.Layout.WG_SPLAT] * n,
                                  plgpu.Layout.WG_SPLAT))
    def gather(_, ll, dst, ws, t):
        ln = lane()
        col = arith.minui(ln, const_i32(63))
        base = mgpu.utils.memref_ptr(ll)
        addrs = [_word_address(base, arith.addi(w.registers[()], col), 8) for w in ws]
        f32 = ir.F32Type.get()
        total = mgpu.utils.inline_ptx(ptx, *addrs, t.registers[()], result_types=f32,
                                      has_side_effects=True)
        first = arith.cmpi(arith.CmpIPredicate.ult, ln, const_i32(64))
        mgpu.utils.inline_ptx("st.shared.f32 [$0], $1;", _smem_address(dst, col), total,
                              predicate=first, has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    gather(ll_ref, dst_smem, [jnp.asarray(w, jnp.int32) for w in words], jnp.asarray(tag, jnp.int32))


def softmax_start(rows: int, width: int):
    """The online softmax's starting carry for `rows` query rows: the fp32 output
    accumulator [rows, width] (zeros), the running max (-inf) and the running sum (0)."""
    return (plgpu.layout_cast(jnp.zeros((rows, width), jnp.float32), WGMMA),
            plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), ROW),
            plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), ROW))


def stamp(ref, index):
    """Thread 0 of the warpgroup writes {%globaltimer's low 32 bits (ns), %clock (SM
    cycles)} to int32 ref[2 index], ref[2 index + 1] (global): a trace point of a kernel
    under study. The timer is grid-wide, the clock per SM (finer; for spans inside one
    block). GPU only (inline PTX)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def emit(_, r, i):
        addr = _word_address(mgpu.utils.memref_ptr(r), i.registers[()], 8)
        mgpu.utils.inline_ptx(
            "{ .reg .pred p; .reg .u64 t; .reg .b32 lo, hi, c; setp.eq.u32 p, $1, 0;"
            " mov.u64 t, %globaltimer; mov.u32 c, %clock; mov.b64 {lo, hi}, t;"
            " @p st.global.v2.b32 [$0], {lo, c}; }",
            addr, lane(), has_side_effects=True)

    emit(ref, jnp.asarray(index, jnp.int32))


def prefetch_rows_l2(ref, row0, col0, row_elems: int, rows: int = 64):
    """Lanes 0 .. rows - 1 each ask L2 for the 128-byte line of 2-byte elements at
    (row0 + lane) * row_elems + col0 of the global ref, seen as rows of `row_elems` (a weight
    tile's rows: [64, 64] bf16 is one line a row): `prefetch.global.L2`, which does not wait.
    Row and column are int32; the address is 64-bit. GPU only (inline PTX)."""
    @plgpu.inline_mgpu(arg_types=(read_ref(), plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT))
    def emit(_, r, row, col):
        mgpu.utils.inline_ptx(
            "{ .reg .pred p; .reg .u32 w; .reg .u64 a; .reg .u64 c; setp.lt.u32 p, $4, $5;"
            " add.u32 w, $1, $4; mul.wide.u32 a, w, $3; cvt.u64.u32 c, $2; add.u64 a, a, c;"
            " shl.b64 a, a, 1; add.u64 a, a, $0; @p prefetch.global.L2 [a]; }",
            ptr64(r), row.registers[()], col.registers[()], const_i32(row_elems), lane(),
            const_i32(rows), has_side_effects=True)

    emit(ref, jnp.asarray(row0, jnp.int32), jnp.asarray(col0, jnp.int32))


def zero_words(ref, start, count: int):
    """The warpgroup writes 0 to int32 words start .. start + count - 1 of the global ref
    (each thread every 128th), then a warpgroup barrier: stores after it, by any thread of
    the warpgroup, land after these. GPU only (inline PTX)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def emit(_, r, s):
        first = arith.addi(s.registers[()], lane())
        mgpu.utils.inline_ptx(
            "{ .reg .pred p; .reg .u32 i; .reg .u64 a; mov.u32 i, $1;"
            " ZW_L: setp.ge.u32 p, i, $2; @p bra ZW_E; mul.wide.u32 a, i, 4; add.u64 a, a, $0;"
            " st.global.b32 [a], 0; add.u32 i, i, 128; bra ZW_L; ZW_E: }",
            ptr64(r), first, arith.addi(s.registers[()], const_i32(count)), has_side_effects=True)
        mgpu.utils.warpgroup_barrier()

    emit(ref, jnp.asarray(start, jnp.int32))
