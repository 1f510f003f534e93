"""Feasibility probe of a persistent decode "megakernel": an L-layer chain of a Llama block's
matrix-vector work (no attention) at batch 1, XLA against Pallas Triton, phased (4 launches
per layer) against persistent (one launch, grid barriers, prefetch across barriers on/off).

The idea is Hazy Research's megakernel (Spector et al., "Look Ma, No Bubbles! Designing a
Low-Latency Megakernel for Llama-1B", May 2025); the kernel and its math are in
`pallas_kernels/persistent_decode.py`. Shapes: "350m" (d 1024, n1 3072, f 2816, 24 layers)
and "1b" (d 2048, n1 6144, f 5632, 22 layers), bf16 weights, random with a fixed seed.

Variants per preset, each group in its own subprocess with a timeout (a deadlocked
barrier or a crash costs that variant only):

* `xla` group: `xla_unrolled` (reference_chain under jit, Python-unrolled layers, math
  layout [in, out]), `xla_scan` (the same with lax.scan), `xla_packed` (unrolled, the
  kernel's output-major layout: one row reduction per product), and `read_only` (a jitted
  jnp.sum(w, dtype=f32) over every weight array: the bandwidth reference).
* `phased@<tiling>`: the Pallas kernels, one launch per phase.
* `persistent@<tiling>[,noprefetch][,atomic-spin]`: one launch for the whole chain.

Each row: max error relative to max |reference| (against xla_unrolled's output), ms per
chain (best of 3 rounds of 20 calls back to back with one synchronisation), ms per layer,
effective TB/s = weight bytes / time, and its ratio to read_only's TB/s. Writes
`persistent_decode.json` to --out ($OUT) after every group and prints a table.

    python experiments/bench_persistent_decode.py --out $OUT           # GPU, < 4 min
    python experiments/bench_persistent_decode.py --smoke --out /tmp/x # CPU, interpret
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

TILINGS = {  # name -> Tiling kwargs (see pallas_kernels.persistent_decode.Tiling)
    "w8": dict(num_warps=8),
    "w4": dict(num_warps=4),
    "w8s": dict(num_warps=8, unit_bytes=16 * 1024, inflight_bytes=32 * 1024),
    "tiny": dict(programs=4, unit_bytes=512, inflight_bytes=1024, k_block=64, num_warps=4),
}
SMOKE_DIMS = dict(d=64, n1=96, f=80, layers=2)


def variant_specs(presets, smoke: bool) -> list[dict]:
    """The sweep, most important first (a time budget cuts the tail)."""
    if smoke:
        return [dict(group="xla", preset="smoke"),
                dict(group="pallas", preset="smoke", mode="phased", tiling="tiny")]
    core, extra = [], []
    for p in presets:
        core += [dict(group="xla", preset=p),
                 dict(group="pallas", preset=p, mode="persistent", tiling="w8", prefetch=True),
                 dict(group="pallas", preset=p, mode="persistent", tiling="w8", prefetch=False),
                 dict(group="pallas", preset=p, mode="phased", tiling="w8")]
        extra += [dict(group="pallas", preset=p, mode="persistent", tiling="w4", prefetch=True),
                  dict(group="pallas", preset=p, mode="persistent", tiling="w8s", prefetch=True),
                  dict(group="pallas", preset=p, mode="persistent", tiling="w8", prefetch=True,
                       spin="atomic"),
                  dict(group="pallas", preset=p, mode="persistent", tiling="w8s",
                       prefetch=False)]
    return core + extra


def variant_name(spec: dict) -> str:
    if spec["group"] == "xla":
        return "xla"
    name = f"{spec['mode']}@{spec['tiling']}"
    if spec["mode"] == "persistent":
        name += "" if spec.get("prefetch", True) else ",noprefetch"
        name += ",atomic-spin" if spec.get("spin") == "atomic" else ""
    return name


# ----------------------------------------------------------------------------- worker

def worker(spec: dict) -> None:
    """Runs one group in this process; prints one `RESULT {json}` line per row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gendist.timing import pipelined_seconds
    from pallas_kernels import persistent_decode as pd

    smoke = spec["preset"] == "smoke"
    dims = SMOKE_DIMS if smoke else pd.PRESETS[spec["preset"]]
    L, d, n1, f = dims["layers"], dims["d"], dims["n1"], dims["f"]
    interpret = smoke
    weights = jax.jit(lambda k: pd.init_weights(k, layers=L, d=d, n1=n1, f=f))(
        jax.random.key(0))
    packed = jax.jit(pd.pack_weights)(weights)
    x = jax.random.normal(jax.random.key(1), (1, d), jnp.float32)
    nbytes = pd.weight_bytes(packed)
    base = dict(preset=spec["preset"], layers=L, d=d, n1=n1, f=f, batch=1,
                weight_mb=nbytes / 1e6, device=jax.devices()[0].device_kind,
                jax=jax.__version__)

    ref_path = Path(spec["ref_path"])
    if ref_path.exists():
        ref = np.load(ref_path)
    else:
        ref = np.asarray(jax.jit(pd.reference_chain)(x, weights))
        np.save(ref_path, ref)

    def measure(variant, fn, *args, extra=None):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - t
        row = dict(base, variant=variant, compile_s=round(compile_s, 2), **(extra or {}))
        if out.shape == ref.shape:
            o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
            row["max_rel_err"] = float(np.max(np.abs(o - r)) / np.max(np.abs(r)))
            row["finite"] = bool(np.all(np.isfinite(o)))
        n = 2 if smoke else 20
        sec = min(pipelined_seconds(fn, *args, n=n, warm=1)[0] for _ in range(3))
        row.update(ms=sec * 1e3, ms_per_layer=sec * 1e3 / L, tbps=nbytes / sec / 1e12)
        print("RESULT " + json.dumps(row), flush=True)

    if spec["group"] == "xla":
        arrays = list(packed)
        measure("read_only", jax.jit(lambda ws: sum(jnp.sum(w, dtype=jnp.float32) for w in ws)),
                arrays)
        measure("xla_unrolled", jax.jit(pd.reference_chain), x, weights)
        measure("xla_scan", jax.jit(lambda x, w: pd.reference_chain(x, w, scan=True)), x,
                weights)
        measure("xla_packed", jax.jit(pd.reference_chain_packed), x, packed)
        return

    del weights
    tiling = pd.Tiling(**TILINGS[spec["tiling"]])
    programs = tiling.programs or pd.default_programs(interpret)
    plans = [p.describe() for p in pd.plan_phases(d, n1, f, tiling, programs)]
    kw = dict(mode=spec["mode"], tiling=tiling, interpret=interpret,
              prefetch=spec.get("prefetch", True), spin=spec.get("spin", "volatile"))
    fn = jax.jit(lambda x, w: pd.decode_chain(x, w, **kw))
    measure(variant_name(spec), fn, x, packed,
            extra=dict(programs=programs, tiling=TILINGS[spec["tiling"]], plans=plans,
                       prefetch=kw["prefetch"], spin=kw["spin"]))


# ----------------------------------------------------------------------------- driver

def run_group(spec: dict, timeout: float, env: dict) -> tuple[object, list[dict], str, float]:
    """(exit code or "timeout", RESULT rows, output tail, wall s) of one worker process; on a
    timeout its process group (the worker alone) is killed."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                 json.dumps(spec)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=str(ROOT), start_new_session=True, text=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        log.seek(0)
        out = log.read()
    rows = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    return rc, rows, out[-1500:], time.perf_counter() - t0


def _fmt(row: dict) -> str:
    if "ms" not in row:
        return f"{row['preset']:>6} {row['variant']:<34} {'FAILED: ' + str(row.get('rc'))}"
    err = row.get("max_rel_err")
    ratio = row.get("ratio_to_read_only")
    return (f"{row['preset']:>6} {row['variant']:<34} {row['ms']:9.3f} {row['ms_per_layer']:8.4f} "
            f"{row['tbps']:6.2f} {'' if ratio is None else f'{ratio:5.2f}':>6} "
            f"{'' if err is None else f'{err:.1e}':>8} {row.get('compile_s', ''):>6}")


HEADER = (f"{'preset':>6} {'variant':<34} {'ms/chain':>9} {'ms/layer':>8} {'TB/s':>6} "
          f"{'/ro':>6} {'max_err':>8} {'comp_s':>6}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["350m", "1b"])
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, interpret mode, tiny shapes: XLA and the phased kernel only")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per subprocess")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="start no subprocess that would likely end after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "persistent_decode.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    specs = variant_specs(args.presets, args.smoke)
    results, read_only, longest = [], {}, 0.0
    t_start = time.perf_counter()
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="pdec-ref-") as tmp:
        for spec in specs:
            spec = dict(spec, ref_path=str(Path(tmp) / f"ref_{spec['preset']}.npy"))
            name = variant_name(spec)
            # skip what would likely end past the budget (a group takes about as long as
            # the longest one so far)
            if time.perf_counter() - t_start + longest > args.budget_s:
                results.append(dict(preset=spec["preset"], variant=name, rc="skipped: budget"))
                print(_fmt(results[-1]), flush=True)
                continue
            rc, rows, tail, wall = run_group(spec, args.timeout, env)
            longest = max(longest, wall)
            if not rows or rc != 0:
                rows.append(dict(preset=spec["preset"], variant=name, rc=rc, tail=tail))
            for row in rows:
                row["group_wall_s"] = round(wall, 1)
                if row.get("variant") == "read_only" and "tbps" in row:
                    read_only[row["preset"]] = row["tbps"]
                if "tbps" in row and row["preset"] in read_only:
                    row["ratio_to_read_only"] = row["tbps"] / read_only[row["preset"]]
                results.append(row)
                print(_fmt(row), flush=True)
            out_file.write_text(json.dumps(dict(
                smoke=args.smoke, elapsed_s=round(time.perf_counter() - t_start, 1),
                read_only_tbps=read_only, results=results), indent=1))
    print(f"wrote {out_file} ({time.perf_counter() - t_start:.0f} s)")
    failed = [r for r in results if "ms" not in r]
    return 1 if args.smoke and failed else 0


if __name__ == "__main__":
    sys.exit(main())
