"""Wall-clock timing of jitted calls, the same way everywhere (and as the anchors do)."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_seconds(f, *args, n: int = 20, warm: int = 3) -> float:
    """Median wall time of one synchronised call `f(*args)` after `warm` warm-up calls."""
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))
