"""Wall-clock timing of jitted calls, the same way everywhere (and as the anchors do)."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def call_times(f, *args, n: int = 20, warm: int = 3):
    """(wall times of `n` synchronised calls `f(*args)` after `warm` warm-up calls, the
    output of the first call): callers that need a result take it from the warm-up instead
    of paying for an extra call."""
    first = None
    for i in range(warm):
        out = jax.block_until_ready(f(*args))
        first = out if i == 0 else first
    ts = []
    for i in range(n):
        t = time.perf_counter()
        out = jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
        first = out if warm == 0 and i == 0 else first
    return ts, first


def median_seconds(f, *args, n: int = 20, warm: int = 3) -> float:
    """Median wall time of one synchronised call `f(*args)` after `warm` warm-up calls."""
    return float(np.median(call_times(f, *args, n=n, warm=warm)[0]))


def pipelined_seconds(f, *args, n: int = 20, warm: int = 1):
    """(seconds per call of `n` calls `f(*args)` dispatched back to back and synchronised once
    at the end, the output of the first warm-up call). The host's dispatch of call i+1 runs
    under the device's call i, so for a kernel of about a millisecond this is its device time
    without a synchronisation per call (which adds tens of microseconds, and lets the
    clocks dip between calls)."""
    first = None
    for i in range(warm):
        out = jax.block_until_ready(f(*args))
        first = out if i == 0 else first
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n, first


def warm_gpu(seconds: float = 2.0) -> None:
    """A few seconds of matmuls before the first timing: an idle H200 sits at a low clock
    (345 MHz, measured on one H200)."""
    a = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(f(a))


def result_path(out, stem: str, suffix: str = "", ext: str = "json") -> Path:
    """Where an experiment writes its result: <out>/<stem>_<device kind><suffix>.<ext>
    (`head_kernel_nvidia_h200.json`), the folder made if missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{stem}_{jax.devices()[0].device_kind.replace(' ', '_').lower()}{suffix}.{ext}"


def read_only_tbps(gib: float = 2.0, n: int = 10) -> dict[str, float]:
    """TB/s of a read-only XLA sum over `gib` GiB of bf16: "synced" from the median of n
    synchronised calls (what the floors used up to 2026-12-01), "pipelined" from n calls
    back to back with one synchronisation. On the H200 machine a synchronised call costs
    ~0.1-0.3 ms more than the sum itself, so the synced figure understates the bandwidth
    (3.1-3.4 against 4.1-4.5 TB/s) and overstates a step's share of its floor; the floor
    uses the higher, pipelined one."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    ts, _ = call_times(f, x, n=n, warm=2)
    t_pipe, _ = pipelined_seconds(f, x, n=n, warm=1)
    nbytes = 2 * (int(gib * 2**30) // 2)
    del x
    return {"synced": nbytes / float(np.median(ts)) / 1e12, "pipelined": nbytes / t_pipe / 1e12}
