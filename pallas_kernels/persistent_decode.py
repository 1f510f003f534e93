"""A persistent ("megakernel") decode chain: many layers' matrix-vector work in ONE launch.

Why. At batch 1 a decode step is a few hundred small kernels run back to back; each is
latency-bound (~2 us), so the step streams its weights at a fraction of HBM bandwidth
(`experiments/decode_floor.py`). Hazy Research's "megakernel" (Spector et al., "Look Ma,
No Bubbles! Designing a Low-Latency Megakernel for Llama-1B", hazyresearch.stanford.edu,
May 2025) removes the launch boundaries: one program per SM stays resident for the whole
step, phases are separated by grid-wide barriers in global memory, and each program issues
the loads of its slice of the NEXT phase's weights before it waits at the barrier, so the
weight stream does not stop. This file is a feasibility probe of that idea with the Pallas
Triton backend, not a model component.

The probe's layer (a Llama block without attention; n1 stands in for q|k|v and the output
projection), with layer-stacked weights, bf16 matmul inputs, fp32 accumulation, x in fp32:

    a = bf16(rmsnorm(x) * g1[l]);  u = bf16(a @ W1[l])              d  -> n1
    x = x + u @ W2[l]                                                n1 -> d
    b = bf16(rmsnorm(x) * g2[l]);  gu = b @ W3[l]                    d  -> 2f (gate | up)
    x = x + bf16(silu(gu[:f]) * gu[f:]) @ W4[l]                      f  -> d

`reference_chain` is that math in jnp. The kernel splits each layer into four phases
(norm+W1, W2+residual, norm+W3+SwiGLU, W4+residual). In each phase, program p owns a
contiguous range of "units" (`rows` output features: `rows` rows of the pre-transposed
weight, i.e. a contiguous block of rows*K bf16) and streams them through registers: the
tiles of unit t+depth are loaded before unit t is reduced (`Tiling`, `plan_phases`).
Matrix-vector products are elementwise products summed in fp32 (no tensor cores: B <= 8).

Two ways to run the same phase bodies (`mode`):

* "phased": one pallas_call per phase (4 per layer); the launch boundary is the barrier.
  Runs anywhere, in interpret mode too (that is what the CPU tests check).
* "persistent": ONE pallas_call for the whole chain, grid = number of SMs (all programs
  must be co-resident), phases separated by a grid barrier on an int32 counter in global
  memory (zeroed by the wrapper per call, aliased in/out). The end of phase k (k = 1, 2, ...):

      [prefetch=True: load the next phase's first `depth` units into registers]
      reduce the last `depth` units of this phase, store their outputs
      bar.sync                      every thread's stores of this phase precede ...
      atomic_add(ctr, 1)            ... thread 0's arrival (acq_rel, gpu scope: a release)
      spin: volatile load of ctr until >= k * programs (spin="atomic": atomic_add(ctr, 0))
      atomic_max(ctr, seen)         an acq_rel RMW reading >= target (max changes nothing:
                                    the counter only grows): the acquire
      bar.sync                      every thread ordered after thread 0's acquire
      [prefetch=False: load the next phase's first `depth` units]

  Activations written before a barrier (u, h, x) are read after it with volatile loads
  (which bypass L1). Weights are read-only, so loading them before the wait is legal: with
  prefetch=True they are in flight through this phase's tail, the arrival and the spin.
  Interpret mode runs programs one after another, so a spin barrier would deadlock there:
  persistent mode refuses interpret=True.

Notes on the Pallas Triton API (the same in jax 0.11.2 and 0.12.0.1): `plgpu.atomic_add(ref,
idx, val)` and the other atomics are always acq_rel at gpu scope (no sem/scope argument);
a scalar atomic is executed by one thread of the program. `plgpu.load(...,
cache_modifier=".cg")` raises KeyError in 0.11.2's lowering (fixed in 0.12), so L1 is
bypassed with `volatile=True` instead. jax drops a `while_loop` whose body only reads refs
if its result is unused; the spin's result therefore feeds the acquire RMW.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import is_pow2, plgpu, resolve_interpret, triton_params

PRESETS = {
    "350m": dict(d=1024, n1=3072, f=2816, layers=24),
    "1b": dict(d=2048, n1=6144, f=5632, layers=22),
}
MAX_BATCH = 8
MODES = ("phased", "persistent")


class ChainWeights(NamedTuple):
    """The math layout (x @ W), stacked over layers: g [L, d], W1 [L, d, n1], W2 [L, n1, d],
    W3 [L, d, 2f] (gate | up), W4 [L, f, d]."""
    g1: jax.Array
    w1: jax.Array
    w2: jax.Array
    g2: jax.Array
    w3: jax.Array
    w4: jax.Array


class PackedWeights(NamedTuple):
    """The kernel layout: every matrix pre-transposed so one output feature's weights are a
    contiguous row of K: w1t [L, n1, d], w2t [L, d, n1], w3t [L, 2, f, d] (gate, up),
    w4t [L, d, f]; gains as given."""
    g1: jax.Array
    w1t: jax.Array
    w2t: jax.Array
    g2: jax.Array
    w3t: jax.Array
    w4t: jax.Array


def init_weights(key, *, layers: int, d: int, n1: int, f: int, dtype=jnp.bfloat16
                 ) -> ChainWeights:
    """Random weights scaled 1/sqrt(fan-in) so activations stay O(1) over many layers."""
    ks = jax.random.split(key, 6)

    def mat(k, fan_in, shape):
        return (jax.random.normal(k, shape, jnp.float32) * (fan_in ** -0.5)).astype(dtype)

    gain = lambda k: (1.0 + 0.1 * jax.random.normal(k, (layers, d), jnp.float32)).astype(dtype)
    return ChainWeights(g1=gain(ks[0]), w1=mat(ks[1], d, (layers, d, n1)),
                        w2=mat(ks[2], n1, (layers, n1, d)), g2=gain(ks[3]),
                        w3=mat(ks[4], d, (layers, d, 2 * f)), w4=mat(ks[5], f, (layers, f, d)))


def pack_weights(w: ChainWeights) -> PackedWeights:
    """Math layout -> kernel layout (one transpose on the host side, done once)."""
    L, d, two_f = w.w3.shape
    f = two_f // 2
    return PackedWeights(
        g1=w.g1, w1t=jnp.swapaxes(w.w1, 1, 2), w2t=jnp.swapaxes(w.w2, 1, 2), g2=w.g2,
        w3t=jnp.transpose(w.w3.reshape(L, d, 2, f), (0, 2, 3, 1)),
        w4t=jnp.swapaxes(w.w4, 1, 2))


def weight_bytes(w) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in w)


def _rmsnorm(x, g, eps):
    inv = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv * g.astype(jnp.float32)[None, :]


def reference_layer(x, g1, w1, w2, g2, w3, w4, eps: float = 1e-6):
    """One layer of the probe's math (see the module docstring); x [B, d] fp32."""
    bf = jnp.bfloat16
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    f = w4.shape[0]
    u = dot(_rmsnorm(x, g1, eps).astype(bf), w1)
    x = x + dot(u.astype(bf), w2)
    gu = dot(_rmsnorm(x, g2, eps).astype(bf), w3)
    h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
    return x + dot(h.astype(bf), w4)


def reference_chain(x, weights: ChainWeights, eps: float = 1e-6, *, scan: bool = False):
    """The L-layer chain in pure jnp: layers unrolled with a Python loop (scan=False) or
    lax.scan over the stacked weights. x [B, d] (any float) -> [B, d] fp32."""
    x = x.astype(jnp.float32)
    if scan:
        return lax.scan(lambda c, w: (reference_layer(c, *w, eps=eps), None), x,
                        tuple(weights))[0]
    for l in range(weights.w1.shape[0]):
        x = reference_layer(x, *(a[l] for a in weights), eps=eps)
    return x


def reference_chain_packed(x, packed: PackedWeights, eps: float = 1e-6):
    """The same math on the kernel layout (output-major matrices, the reduced axis minor):
    the form in which XLA runs a one-row product as a single row reduction. Layers unrolled."""
    bf = jnp.bfloat16
    mv = lambda a, wt: lax.dot_general(a.astype(bf), wt, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
    x = x.astype(jnp.float32)
    for l in range(packed.w1t.shape[0]):
        u = mv(_rmsnorm(x, packed.g1[l], eps), packed.w1t[l])
        x = x + mv(u, packed.w2t[l])
        b = _rmsnorm(x, packed.g2[l], eps)
        g, up = mv(b, packed.w3t[l, 0]), mv(b, packed.w3t[l, 1])
        x = x + mv(jax.nn.silu(g) * up, packed.w4t[l])
    return x


# ----------------------------------------------------------------------------- planning

@dataclasses.dataclass(frozen=True)
class Tiling:
    """How each phase's work is cut (`plan_phases` shows the result for given shapes).

    programs: the grid (None: the GPU's SM count; 4 in interpret mode).
    k_block: most columns per tile; a phase's tile width is the largest power of two <= it
      dividing the phase's K.
    unit_bytes: most weight bytes per unit. Rows per unit: a power of two dividing the
      output width, rows * K * 2 * halves <= unit_bytes, rows <= max_rows; the largest one
      whose balance (mean / max units per program) is within balance_slack of the best.
    inflight_bytes: target weight bytes in flight per program; a phase loads its units
      depth = ceil(inflight_bytes / unit bytes) ahead (at most max_depth), at the cost of
      (depth + 1) units of registers.
    """
    programs: int | None = None
    k_block: int = 1024
    unit_bytes: int = 32 * 1024
    inflight_bytes: int = 64 * 1024
    max_depth: int = 8
    max_rows: int = 64
    balance_slack: float = 0.05
    num_warps: int = 8
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    n: int        # output features (per half)
    k: int        # reduction length
    halves: int   # 2 for gate|up (W3), else 1
    rows: int     # output features per unit
    kb: int       # columns per tile
    units: int    # n // rows
    programs: int
    depth: int    # units loaded ahead of the one being reduced

    @property
    def kc(self) -> int:
        return self.k // self.kb

    @property
    def unit_bytes(self) -> int:
        return self.rows * self.k * 2 * self.halves

    @property
    def max_units(self) -> int:   # units of the busiest program
        return -(-self.units // self.programs)

    @property
    def balance(self) -> float:   # mean / max work per program
        return self.units / (self.programs * self.max_units)

    def describe(self) -> dict:
        return dict(n=self.n, k=self.k, halves=self.halves, rows=self.rows, kb=self.kb,
                    units=self.units, depth=self.depth, unit_kib=self.unit_bytes / 1024,
                    max_units=self.max_units, balance=round(self.balance, 3))


def default_programs(interpret: bool) -> int:
    if not interpret and jax.default_backend() == "gpu":
        return int(getattr(jax.devices()[0], "core_count", 132) or 132)
    return 4


def _rows_for(n, k, halves, t: Tiling, programs: int) -> int:
    def balance(r):
        units = n // r
        return units / (programs * -(-units // programs))

    ok = [1]
    while (ok[-1] * 2 <= t.max_rows and ok[-1] * 2 * k * 2 * halves <= t.unit_bytes
           and n % (ok[-1] * 2) == 0):
        ok.append(ok[-1] * 2)
    best = max(balance(r) for r in ok)
    return max(r for r in ok if balance(r) >= best - t.balance_slack)


def plan_phases(d: int, n1: int, f: int, tiling: Tiling, programs: int) -> tuple[PhasePlan, ...]:
    """The four phases' plans (W1, W2, W3, W4). Raises ValueError naming the bad field."""
    if not is_pow2(tiling.k_block):
        raise ValueError(f"tiling.k_block={tiling.k_block} must be a power of two")
    if programs < 1:
        raise ValueError(f"tiling.programs={programs} must be >= 1")
    if tiling.max_depth < 1 or tiling.inflight_bytes < 1:
        raise ValueError("tiling.max_depth and tiling.inflight_bytes must be >= 1")
    out = []
    for n, k, halves in ((n1, d, 1), (d, n1, 1), (f, d, 2), (d, f, 1)):
        kb = min(tiling.k_block, k & -k)      # largest power of two dividing k, capped
        rows = _rows_for(n, k, halves, tiling, programs)
        unit = rows * k * 2 * halves
        depth = max(1, min(tiling.max_depth, -(-tiling.inflight_bytes // unit)))
        out.append(PhasePlan(n=n, k=k, halves=halves, rows=rows, kb=kb, units=n // rows,
                             programs=programs, depth=depth))
    return tuple(out)


# ----------------------------------------------------------------------------- kernel parts

def _unit_range(pid, p: PhasePlan):
    """Program pid's contiguous, balanced range of units [u0, u1)."""
    return (pid * p.units) // p.programs, ((pid + 1) * p.units) // p.programs


def _load_unit(w_ref, p: PhasePlan, l, t, pred=None):
    """The tiles of unit t: a tuple over halves of a tuple over k-chunks of [rows, kb] bf16.
    pred (scalar bool) masks the whole load off (no memory traffic)."""
    t = jnp.minimum(t, p.units - 1)
    rows = pl.ds(t * p.rows, p.rows)
    kw = {} if pred is None else dict(mask=pred, other=0.0)
    out = []
    for h in range(p.halves):
        view = (lambda c, h=h: w_ref.at[l, _i(h), rows, c]) if p.halves == 2 else \
            (lambda c: w_ref.at[l, rows, c])
        out.append(tuple(plgpu.load(view(pl.ds(c * p.kb, p.kb)), eviction_policy="evict_first",
                                    **kw) for c in range(p.kc)))
    return tuple(out)


def _first_units(w_ref, p: PhasePlan, l, pid, pred=True):
    """The loop's initial carry: program pid's first `depth` units (masked past its end)."""
    u0, u1 = _unit_range(pid, p)
    return tuple(_load_unit(w_ref, p, l, u0 + i, jnp.logical_and(u0 + i < u1, pred))
                 for i in range(p.depth))


def _unit_dot(tiles, acts):
    """[B][halves] fp32 [rows] partial products of one unit: sum_k tile[r, k] * act[b][k]."""
    out = []
    for act in acts:
        per_half = []
        for half in tiles:
            acc = None
            for tile, a in zip(half, act, strict=True):
                prod = tile.astype(jnp.float32) * a[None, :]
                acc = prod if acc is None else acc + prod
            per_half.append(jnp.sum(acc, axis=1))
        out.append(per_half)
    return out


def _run_units(w_ref, p: PhasePlan, l, pid, first, acts, epilogue, before_tail=None):
    """Stream program pid's units; `first` holds its first `depth` units. Unit t+depth's
    tiles are loaded before unit t is reduced. Two loops: the body of the first loads, that
    of the tail (the last `depth` units) does not; `before_tail()` runs between them, while
    the tail's tiles are still in flight: the next phase's first units are prefetched there.
    """
    u0, u1 = _unit_range(pid, p)
    D = p.depth
    mid = jnp.maximum(u0, u1 - D)

    def body(t, carry):
        nxt = _load_unit(w_ref, p, l, t + D)           # t + D < u1 here
        epilogue(t, _unit_dot(carry[0], acts))
        return carry[1:] + (nxt,)

    def tail(t, carry):
        epilogue(t, _unit_dot(carry[0], acts))
        return carry[1:] + (jax.tree.map(jnp.zeros_like, carry[0]),)

    carry = lax.fori_loop(u0, mid, body, first)
    extra = before_tail() if before_tail is not None else None
    lax.fori_loop(mid, u1, tail, carry)
    return extra


def _i(v):
    """A static index as an int32 scalar (the interpreter's load discharge wants .shape)."""
    return jnp.int32(v)


def _vload(ref):
    return plgpu.load(ref, volatile=True)


def _norm_acts(x_ref, g_ref, l, B, d, kb, eps):
    """bf16-rounded rmsnorm(x[b]) * g[l], as [B][k-chunk] fp32 vectors of kb."""
    acts = []
    for b in range(B):
        xs = [_vload(x_ref.at[_i(b), pl.ds(c * kb, kb)]) for c in range(d // kb)]
        ss = sum(jnp.sum(v * v) for v in xs)
        inv = lax.rsqrt(ss / d + eps)
        acts.append([(v * inv * g_ref[l, pl.ds(c * kb, kb)].astype(jnp.float32))
                     .astype(jnp.bfloat16).astype(jnp.float32) for c, v in enumerate(xs)])
    return acts


def _vec_acts(v_ref, B, k, kb):
    return [[_vload(v_ref.at[_i(b), pl.ds(c * kb, kb)]).astype(jnp.float32)
             for c in range(k // kb)] for b in range(B)]


def _store_rows(dst_ref, p: PhasePlan):
    def epi(t, accs):
        for b, (acc,) in enumerate(accs):
            plgpu.store(dst_ref.at[_i(b), pl.ds(t * p.rows, p.rows)], acc.astype(dst_ref.dtype))
    return epi


def _residual_rows(src_ref, dst_ref, p: PhasePlan):
    def epi(t, accs):
        for b, (acc,) in enumerate(accs):
            rows = pl.ds(t * p.rows, p.rows)
            plgpu.store(dst_ref.at[_i(b), rows], _vload(src_ref.at[_i(b), rows]) + acc)
    return epi


def _swiglu_rows(h_ref, p: PhasePlan):
    def epi(t, accs):
        for b, (g, up) in enumerate(accs):
            h = g / (1.0 + jnp.exp(-g)) * up
            plgpu.store(h_ref.at[_i(b), pl.ds(t * p.rows, p.rows)], h.astype(h_ref.dtype))
    return epi


# ----------------------------------------------------------------------------- phased mode

def _phase1_kernel(lid_ref, x_ref, g_ref, w_ref, u_ref, *, p, B, d, eps):
    l, pid = lid_ref[0], pl.program_id(0)
    acts = _norm_acts(x_ref, g_ref, l, B, d, p.kb, eps)
    _run_units(w_ref, p, l, pid, _first_units(w_ref, p, l, pid), acts, _store_rows(u_ref, p))


def _phase2_kernel(lid_ref, v_ref, w_ref, x_ref, x_out, *, p, B):
    # phases 2 and 4: x_out (aliased to x) += v @ W
    l, pid = lid_ref[0], pl.program_id(0)
    acts = _vec_acts(v_ref, B, p.k, p.kb)
    _run_units(w_ref, p, l, pid, _first_units(w_ref, p, l, pid), acts,
               _residual_rows(x_ref, x_out, p))


def _phase3_kernel(lid_ref, x_ref, g_ref, w_ref, h_ref, *, p, B, d, eps):
    l, pid = lid_ref[0], pl.program_id(0)
    acts = _norm_acts(x_ref, g_ref, l, B, d, p.kb, eps)
    _run_units(w_ref, p, l, pid, _first_units(w_ref, p, l, pid), acts, _swiglu_rows(h_ref, p))


def _phased_chain(x, w: PackedWeights, plans, tiling, programs, interpret, eps, debug):
    B, d = x.shape
    L = w.w1t.shape[0]
    p1, p2, p3, p4 = plans
    common = dict(grid=(programs,), interpret=interpret, debug=debug,
                  compiler_params=triton_params(tiling.num_warps, tiling.num_stages))
    k1 = pl.pallas_call(functools.partial(_phase1_kernel, p=p1, B=B, d=d, eps=eps),
                        out_shape=jax.ShapeDtypeStruct((B, p1.n), jnp.bfloat16),
                        name="pdec_phase1", **common)
    k2 = pl.pallas_call(functools.partial(_phase2_kernel, p=p2, B=B),
                        out_shape=jax.ShapeDtypeStruct((B, d), jnp.float32),
                        input_output_aliases={3: 0}, name="pdec_phase2", **common)
    k3 = pl.pallas_call(functools.partial(_phase3_kernel, p=p3, B=B, d=d, eps=eps),
                        out_shape=jax.ShapeDtypeStruct((B, p3.n), jnp.bfloat16),
                        name="pdec_phase3", **common)
    k4 = pl.pallas_call(functools.partial(_phase2_kernel, p=p4, B=B),
                        out_shape=jax.ShapeDtypeStruct((B, d), jnp.float32),
                        input_output_aliases={3: 0}, name="pdec_phase4", **common)
    for l in range(L):
        lid = jnp.full((1,), l, jnp.int32)
        u = k1(lid, x, w.g1, w.w1t)
        x = k2(lid, u, w.w2t, x)
        h = k3(lid, x, w.g2, w.w3t)
        x = k4(lid, h, w.w4t, x)
    return x


# ----------------------------------------------------------------------------- persistent mode

def _arrive(ctr_ref):
    plgpu.debug_barrier()                              # every thread's stores, then ...
    plgpu.atomic_add(ctr_ref, (0,), jnp.int32(1))      # ... one release by thread 0


def _wait(ctr_ref, target, spin: str):
    if spin == "atomic":
        read = lambda _: plgpu.atomic_add(ctr_ref, (0,), jnp.int32(0))
    else:
        read = lambda _: plgpu.load(ctr_ref.at[0], volatile=True)
    seen = lax.while_loop(lambda v: v < target, read, read(None))
    # The acquire: an acq_rel RMW that reads the counter (>= target now). It takes the spin's
    # result as its operand (max(ctr, seen) == ctr: the counter only grows), which also keeps
    # the loop alive: jax drops a while loop that only reads refs when its result is unused.
    plgpu.atomic_max(ctr_ref, (0,), seen)
    plgpu.debug_barrier()


def _persistent_kernel(x_in, g1, w1, w2, g2, w3, w4, ctr_in, x_ref, u_ref, h_ref, ctr_ref,
                       *, plans, B, d, L, eps, prefetch, spin):
    del x_in, ctr_in  # aliased to x_ref and ctr_ref
    p1, p2, p3, p4 = plans
    P = p1.programs
    pid = pl.program_id(0)

    def run(w_ref, p, l, first, acts, epi, k, load_next, need_barrier=None):
        pre = _run_units(w_ref, p, l, pid, first, acts, epi,
                         before_tail=load_next if prefetch else None)
        if need_barrier is None:
            _arrive(ctr_ref)
            _wait(ctr_ref, k * P, spin)
        else:
            @pl.when(need_barrier)
            def _():
                _arrive(ctr_ref)
                _wait(ctr_ref, k * P, spin)
        return pre if prefetch else load_next()

    def layer(l, first1):
        k0 = l * 4
        nl = jnp.minimum(l + 1, L - 1)
        more = l + 1 < L
        first2 = run(w1, p1, l, first1, _norm_acts(x_ref, g1, l, B, d, p1.kb, eps),
                     _store_rows(u_ref, p1), k0 + 1, lambda: _first_units(w2, p2, l, pid))
        first3 = run(w2, p2, l, first2, _vec_acts(u_ref, B, p2.k, p2.kb),
                     _residual_rows(x_ref, x_ref, p2), k0 + 2,
                     lambda: _first_units(w3, p3, l, pid))
        first4 = run(w3, p3, l, first3, _norm_acts(x_ref, g2, l, B, d, p3.kb, eps),
                     _swiglu_rows(h_ref, p3), k0 + 3, lambda: _first_units(w4, p4, l, pid))
        return run(w4, p4, l, first4, _vec_acts(h_ref, B, p4.k, p4.kb),
                   _residual_rows(x_ref, x_ref, p4), k0 + 4,
                   lambda: _first_units(w1, p1, nl, pid, more), need_barrier=more)

    lax.fori_loop(0, L, layer, _first_units(w1, p1, 0, pid))


def _persistent_chain(x, w: PackedWeights, plans, tiling, programs, eps, prefetch, spin, debug):
    B, d = x.shape
    L = w.w1t.shape[0]
    p1, _, p3, _ = plans
    kernel = functools.partial(_persistent_kernel, plans=plans, B=B, d=d, L=L, eps=eps,
                               prefetch=prefetch, spin=spin)
    ctr = jnp.zeros((1,), jnp.int32)
    out = pl.pallas_call(
        kernel, grid=(programs,), debug=debug, name="pdec_persistent",
        out_shape=[jax.ShapeDtypeStruct((B, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, p1.n), jnp.bfloat16),
                   jax.ShapeDtypeStruct((B, p3.n), jnp.bfloat16),
                   jax.ShapeDtypeStruct((1,), jnp.int32)],
        input_output_aliases={0: 0, 7: 3},
        compiler_params=triton_params(tiling.num_warps, tiling.num_stages),
    )(x, w.g1, w.w1t, w.w2t, w.g2, w.w3t, w.w4t, ctr)
    return out[0]


# ----------------------------------------------------------------------------- entry point

@functools.partial(jax.jit, static_argnames=("mode", "tiling", "prefetch", "spin", "interpret",
                                             "eps", "debug"))
def decode_chain(x, packed: PackedWeights, *, mode: str = "phased", tiling: Tiling = Tiling(),
                 prefetch: bool = True, spin: str = "volatile", interpret: bool | None = None,
                 eps: float = 1e-6, debug: bool = False):
    """The L-layer chain of `reference_chain` with Pallas Triton kernels.

    x [B, d] (B <= 8), packed: `pack_weights(...)`. mode "phased" (4 launches per layer) or
    "persistent" (one launch, grid barriers; GPU only). prefetch/spin only matter for
    "persistent". interpret=None: interpret on a host without a GPU. Returns x [B, d] fp32.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    if spin not in ("volatile", "atomic"):
        raise ValueError(f"spin={spin!r}; expected 'volatile' or 'atomic'")
    interpret = resolve_interpret(interpret)
    if mode == "persistent" and interpret:
        raise ValueError("mode='persistent' cannot run with interpret=True: interpret mode "
                         "runs the programs one after another, so the first program would "
                         "spin forever at the grid barrier. Use mode='phased' on CPU, or "
                         "compile for a GPU (interpret=False).")
    if x.ndim != 2:
        raise ValueError(f"x has shape {x.shape}; expected [batch, d]")
    B, d = x.shape
    if not 1 <= B <= MAX_BATCH:
        raise ValueError(f"x batch={B}; the probe takes 1..{MAX_BATCH} rows")
    L, n1, d1 = packed.w1t.shape
    f = packed.w4t.shape[2]
    if d1 != d:
        raise ValueError(f"x width {d} != weights' d {d1}")
    programs = tiling.programs or default_programs(interpret)
    plans = plan_phases(d, n1, f, tiling, programs)
    x = x.astype(jnp.float32)
    if mode == "phased":
        return _phased_chain(x, packed, plans, tiling, programs, interpret, eps, debug)
    return _persistent_chain(x, packed, plans, tiling, programs, eps, prefetch, spin, debug)
