"""Split layers into pipeline stages from costs measured on the device.

A pipeline runs at the pace of its slowest stage, so the split minimises the largest stage
time (forward + backward of its layers, plus the embedding on the first stage and the head
on the last) subject to each stage's memory fitting a cap. Contiguous splits of a chain
are a classic dynamic programme (the "linear partition" problem), as in PipeDream's
planner (Narayanan et al. 2019) and the layer balancing of GPipe (Huang et al. 2019);
costs come from profiling, not from parameter counts, because attention, embedding and
head costs do not scale with parameters alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gendist.parallel.pipeline.table import BACKWARD, FORWARD
from gendist.timing import median_seconds


@dataclasses.dataclass(frozen=True)
class Cost:
    """Measured forward+backward cost of one piece of the model."""

    time_s: float  # median wall time of the jitted forward + backward
    memory_bytes: int  # arguments + outputs + temporaries of the compiled program
    fwd_time_s: float | None = None  # median wall time of the forward alone (when measured)


def profile_fwd_bwd(fn: Callable, *args, repeats: int = 5) -> Cost:
    """Times `fn`'s forward and backward (w.r.t. all `args`, all floating) on the device and
    reads its memory from `compiled.memory_analysis()`."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")

    def fwd_bwd(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(jax.tree.map(jnp.ones_like, out))

    compiled = jax.jit(fwd_bwd).lower(*args).compile()
    total = median_seconds(compiled, *args, n=repeats, warm=1)
    forward = median_seconds(jax.jit(fn).lower(*args).compile(), *args, n=repeats, warm=1)
    mem = compiled.memory_analysis()
    nbytes = 0 if mem is None else (
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
    return Cost(total, int(nbytes), forward)


def profile_model(params, tokens_BT, targets_BT, *, embed_fn, layer_fn, head_loss_fn,
                  repeats: int = 5) -> tuple[Cost, list[Cost], Cost]:
    """(embedding, per-layer, head+loss) costs for one microbatch `tokens_BT`."""
    x_BTD = embed_fn(params["embed"], tokens_BT)
    embed = profile_fwd_bwd(lambda e: embed_fn(e, tokens_BT), params["embed"], repeats=repeats)
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    layers = [profile_fwd_bwd(layer_fn, jax.tree.map(lambda a, i=i: a[i], params["layers"]),
                              x_BTD, repeats=repeats) for i in range(num_layers)]
    head = profile_fwd_bwd(lambda h, x: head_loss_fn(h, x, targets_BT)[0], params["head"],
                           x_BTD, repeats=repeats)
    return embed, layers, head


@dataclasses.dataclass(frozen=True)
class Partition:
    """Layers per stage and the resulting per-stage cost."""

    counts: tuple[int, ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_time)


class _Costs:
    """Per-stage time and memory of layers [i, j) placed on stage k, from prefix sums."""

    def __init__(self, layer_time, num_stages, layer_memory, memory_cap, first_time,
                 last_time, first_memory, last_memory):
        t = np.asarray(layer_time, np.float64)
        if t.ndim != 1 or (t < 0).any():
            raise ValueError("layer_time must be a 1-D sequence of non-negative times")
        if not isinstance(num_stages, int | np.integer) or num_stages < 1:
            raise ValueError(f"num_stages={num_stages!r} must be an int >= 1")
        if len(t) < num_stages:
            raise ValueError(f"layer_time: {len(t)} layers cannot fill {num_stages} stages; "
                             "use at most as many stages as layers")
        mem = np.zeros_like(t) if layer_memory is None else np.asarray(layer_memory, np.float64)
        if mem.shape != t.shape:
            raise ValueError(f"layer_memory has {mem.shape[0]} entries; give one per layer ({len(t)})")
        self.p, self.num_layers = int(num_stages), len(t)
        self.cap = np.inf if memory_cap is None else float(memory_cap)
        self.t_cum = np.concatenate([[0.0], np.cumsum(t)])
        self.m_cum = np.concatenate([[0.0], np.cumsum(mem)])
        self.extra_t = np.zeros(self.p)
        self.extra_m = np.zeros(self.p)
        self.extra_t[0] += first_time
        self.extra_t[-1] += last_time
        self.extra_m[0] += first_memory
        self.extra_m[-1] += last_memory

    def time(self, k, i, j):
        return self.t_cum[j] - self.t_cum[i] + self.extra_t[k]

    def memory(self, k, i, j):
        return self.m_cum[j] - self.m_cum[i] + self.extra_m[k]

    def fits(self, k, i, j):
        return self.memory(k, i, j) <= self.cap

    def result(self, bounds) -> Partition:
        if bounds is None:
            raise ValueError(f"memory_cap={self.cap} is below what some stage needs in every "
                             "split; raise the cap or use more pipeline stages")
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        return Partition(tuple(j - i for i, j in spans),
                         tuple(float(self.time(k, i, j)) for k, (i, j) in enumerate(spans)),
                         tuple(float(self.memory(k, i, j)) for k, (i, j) in enumerate(spans)))


def partition_layers(layer_time: Sequence[float], num_stages: int, *,
                     layer_memory: Sequence[float] | None = None,
                     memory_cap: float | None = None, first_time: float = 0.0,
                     last_time: float = 0.0, first_memory: float = 0.0,
                     last_memory: float = 0.0) -> Partition:
    """Contiguous split of L layers into `num_stages` non-empty stages that minimises the
    slowest stage, with every stage's memory <= `memory_cap`. O(p L^2) dynamic programme:
    best[k, j] is the smallest bottleneck placing layers [0, j) on stages 0..k."""
    c = _Costs(layer_time, num_stages, layer_memory, memory_cap, first_time, last_time,
               first_memory, last_memory)
    p, n = c.p, c.num_layers
    best = np.full((p, n + 1), np.inf)
    cut = np.zeros((p, n + 1), np.int64)
    for j in range(1, n + 1):
        if c.fits(0, 0, j):
            best[0, j] = c.time(0, 0, j)
    for k in range(1, p):
        for j in range(k + 1, n + 1):
            for i in range(k, j):  # stage k holds layers [i, j)
                if best[k - 1, i] < np.inf and c.fits(k, i, j):
                    cand = max(best[k - 1, i], c.time(k, i, j))
                    if cand < best[k, j]:
                        best[k, j], cut[k, j] = cand, i
    if best[p - 1, n] == np.inf:
        return c.result(None)
    bounds = [n]
    for k in range(p - 1, 0, -1):
        bounds.append(int(cut[k, bounds[-1]]))
    return c.result([0] + bounds[::-1])


def brute_force_partition(layer_time: Sequence[float], num_stages: int, **kwargs) -> Partition:
    """Reference for tests: tries every contiguous split (same arguments as partition_layers)."""
    c = _Costs(layer_time, num_stages, kwargs.get("layer_memory"), kwargs.get("memory_cap"),
               kwargs.get("first_time", 0.0), kwargs.get("last_time", 0.0),
               kwargs.get("first_memory", 0.0), kwargs.get("last_memory", 0.0))
    best, best_bounds = np.inf, None
    for bounds, spans in _fitting_splits(c):
        value = max(c.time(k, i, j) for k, (i, j) in spans)
        if value < best:
            best, best_bounds = value, bounds
    return c.result(best_bounds)


def _fitting_splits(c: _Costs):
    """Every contiguous split of c's layers into c.p non-empty stages within the memory cap,
    as (stage bounds, [(stage, (first layer, end layer))])."""
    for cuts in itertools.combinations(range(1, c.num_layers), c.p - 1):
        bounds = [0, *cuts, c.num_layers]
        spans = list(enumerate(zip(bounds[:-1], bounds[1:], strict=True)))
        if all(c.fits(k, i, j) for k, (i, j) in spans):
            yield bounds, spans


def _model_costs(embed: Cost, layers: Sequence[Cost], head: Cost, forward: bool = False
                 ) -> dict:
    """`partition_layers` keywords from `profile_model`'s costs (forward+backward times, or
    the forward alone)."""
    t = (lambda c: c.fwd_time_s) if forward else (lambda c: c.time_s)
    return dict(layer_time=[t(c) for c in layers], layer_memory=[c.memory_bytes for c in layers],
                first_time=t(embed), last_time=t(head), first_memory=embed.memory_bytes,
                last_memory=head.memory_bytes)


def plan_stages(embed: Cost, layers: Sequence[Cost], head: Cost, num_stages: int,
                memory_cap: float | None = None) -> Partition:
    """`partition_layers` from `profile_model`'s costs."""
    return partition_layers(num_stages=num_stages, memory_cap=memory_cap,
                            **_model_costs(embed, layers, head))


def evaluate_split(embed: Cost, layers: Sequence[Cost], head: Cost, counts: Sequence[int],
                   forward: bool = False) -> Partition:
    """The stage times and memory of a given split (layers per stage), costed as
    `plan_stages` costs its own; `forward` uses the forward times alone."""
    kw = _model_costs(embed, layers, head, forward)
    c = _Costs(kw.pop("layer_time"), len(counts), kw.pop("layer_memory"), None, **kw)
    return c.result(list(itertools.accumulate((0, *(int(n) for n in counts)))))


def lockstep_step_time(schedule, stage_time: Sequence[float],
                       stage_fwd_time: Sequence[float] | None = None, *,
                       fwd_fraction: float = 1 / 3, recompute: bool = True) -> float:
    """Step time of `schedule` when every time step ends in a barrier, as in gendist's SPMD
    executor (each step ends with the ppermutes that pass activations and gradients on):
    the sum over steps of the slowest stage's action.

    `stage_time[s]` is stage s's forward+backward time, `stage_fwd_time[s]` its forward
    (default `fwd_fraction` of the total). A forward action costs the forward; a backward
    action costs the whole forward+backward when the executor recomputes the forward under
    `jax.vjp` (`recompute`, as gendist's does), else the rest.

    Asynchronous pipelines (PipeDream) run at the pace of the slowest stage, which is what
    `partition_layers` minimises; under lock-step a stage also waits for its neighbours'
    actions every step, and the warm-up and cool-down steps run the end stages alone.
    """
    t = np.asarray(stage_time, np.float64)
    if t.shape != (schedule.num_stages,):
        raise ValueError(f"stage_time has {t.size} entries; the schedule has "
                         f"{schedule.num_stages} stages")
    f = fwd_fraction * t if stage_fwd_time is None else np.asarray(stage_fwd_time, np.float64)
    if f.shape != t.shape:
        raise ValueError(f"stage_fwd_time has {f.size} entries; stage_time has {t.size}")
    b = t if recompute else t - f
    cost = np.where(schedule.kind == FORWARD, f[None, :],
                    np.where(schedule.kind == BACKWARD, b[None, :], 0.0))
    return float(cost.max(axis=1).sum())


def partition_layers_lockstep(layer_time: Sequence[float], schedule, *,
                              layer_fwd_time: Sequence[float] | None = None,
                              first_fwd_time: float | None = None,
                              last_fwd_time: float | None = None,
                              fwd_fraction: float = 1 / 3, recompute: bool = True,
                              max_splits: int = 200_000, **kwargs) -> tuple[Partition, float]:
    """The contiguous split minimising `lockstep_step_time` under the memory cap, by trying
    every split (C(L-1, p-1) of them: the objective is a sum of per-step maxima, which the
    min-max programme does not capture). Forward times default to `fwd_fraction` of each
    piece's forward+backward. Other keywords as `partition_layers`. Returns (partition,
    predicted step time)."""
    p = schedule.num_stages
    c = _Costs(layer_time, p, kwargs.get("layer_memory"), kwargs.get("memory_cap"),
               kwargs.get("first_time", 0.0), kwargs.get("last_time", 0.0),
               kwargs.get("first_memory", 0.0), kwargs.get("last_memory", 0.0))
    lf = (fwd_fraction * np.asarray(layer_time, np.float64) if layer_fwd_time is None
          else np.asarray(layer_fwd_time, np.float64))
    ff = fwd_fraction * kwargs.get("first_time", 0.0) if first_fwd_time is None else first_fwd_time
    lf_last = fwd_fraction * kwargs.get("last_time", 0.0) if last_fwd_time is None else last_fwd_time
    fwd = _Costs(lf, p, None, None, ff, lf_last, 0.0, 0.0)
    n_splits = math.comb(c.num_layers - 1, c.p - 1)
    if n_splits > max_splits:
        raise ValueError(f"{n_splits} contiguous splits of {c.num_layers} layers over {c.p} "
                         f"stages exceed max_splits={max_splits}; raise it or use "
                         "partition_layers (min-max dynamic programme)")
    best, best_bounds = np.inf, None
    for bounds, spans in _fitting_splits(c):
        value = lockstep_step_time(schedule, [c.time(k, i, j) for k, (i, j) in spans],
                                   [fwd.time(k, i, j) for k, (i, j) in spans],
                                   recompute=recompute)
        if value < best:
            best, best_bounds = value, bounds
    return c.result(best_bounds), float(best)
