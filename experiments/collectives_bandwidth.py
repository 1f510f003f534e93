"""Collective bandwidth over all devices: all-reduce, all-gather, reduce-scatter, all-to-all
and a ring permute, timed inside one jitted `shard_map` each, set against the ring model in
`gendist.collectives.wire_bytes` (the bytes each device sends).

    python experiments/collectives_bandwidth.py --out $OUT     # on a machine with >= 2 GPUs

Reports, per size, the algorithm bandwidth (payload / time) and the bus bandwidth
(wire bytes per device / time), nccl-tests' two figures (NVIDIA, nccl-tests
doc/PERFORMANCE.md): the bus bandwidth is what the model says the links carry, so it should
sit flat near the link rate once messages are large. Writes `collectives_<n>dev.json`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gendist.collectives import wire_bytes
from gendist.parallel.compat import shard_map
from gendist.timing import median_seconds


def collectives(n: int):
    """name -> (per-device fn on the local block, accounting kind)."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    return {
        "all-reduce": (lambda x: jax.lax.psum(x, "d"), "all-reduce"),
        "all-gather": (lambda x: jax.lax.all_gather(x, "d", tiled=True), "all-gather"),
        "reduce-scatter": (lambda x: jax.lax.psum_scatter(x, "d", tiled=True), "reduce-scatter"),
        "all-to-all": (lambda x: jax.lax.all_to_all(x, "d", 0, 0, tiled=True), "all-to-all"),
        "permute": (lambda x: jax.lax.ppermute(x, "d", perm), "collective-permute"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64, 256, 1024],
                    help="payload per device (MiB): the block each device holds")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    args = ap.parse_args()
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        raise SystemExit(f"{n} device: collectives need at least 2 (on a CPU, set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8).")
    mesh = Mesh(np.array(devices), ("d",))
    res = {"device": devices[0].device_kind, "devices": n, "jax": jax.__version__, "rows": []}
    print(f"{'op':15} {'MiB/dev':>8} {'ms':>8} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for mib in args.sizes_mib:
        elems = int(mib * 2**20) // 2 // n * n  # bf16, divisible by n for the tiled ops
        x = jax.device_put(jnp.ones((n * elems,), jnp.bfloat16), NamedSharding(mesh, P("d")))
        payload = 2 * elems  # bytes per device
        for name, (op, kind) in collectives(n).items():
            fn = jax.jit(shard_map(op, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                   check=False))
            s = median_seconds(fn, x, n=args.reps, warm=1)
            # nccl-tests conventions: all-gather's payload is the gathered output; the others'
            # is the input block. wire_bytes takes the full (unsharded) payload.
            full = payload * n if kind == "all-gather" else payload
            sent = wire_bytes(kind, full, n)
            row = {"op": name, "payload_bytes": full, "seconds": s,
                   "algbw_GBps": full / s / 1e9, "busbw_GBps": sent / s / 1e9,
                   "model_wire_bytes": sent}
            res["rows"].append(row)
            print(f"{name:15} {mib:8.1f} {s * 1e3:8.3f} {row['algbw_GBps']:11.1f} "
                  f"{row['busbw_GBps']:11.1f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"collectives_{n}dev.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
