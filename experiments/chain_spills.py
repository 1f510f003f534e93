"""What does ptxas make of the decode megakernel: its registers, its spills, and does it
serialise the kernel's wgmma?

Compiles the chain megakernel (2 layers, norms, attention at capacity 320) for the presets'
shapes and Llama-3.2-1B's, each in its own process under MOSAIC_GPU_DUMP_PTXAS=1, and reads
ptxas's report: registers a thread, spill bytes, and its performance warnings (C7520: "wgmma
instructions are serialized due to program dependence on compiler-inserted WG.AR in
divergent path"; C7519: a `warpgroup.arrive` ptxas added before a wgmma). `--aot` compiles
deviceless for an H200 (no GPU needed: the CUDA plugin and ptxas from pip, as
`decode_hlo_h200.py` sets up); the report is ptxas's own, the same as on the GPU.

    pip install --no-deps --target /tmp/cuda_aot jax-cuda13-pjrt==$JAXVER jax-cuda13-plugin==$JAXVER \\
        "nvidia-cuda-nvcc==13.0.*"
    PATH=/tmp/cuda_aot/nvidia/cu13/bin:$PATH PYTHONPATH=.:/tmp/cuda_aot \\
        python3 experiments/chain_spills.py --aot --tiles 1 4 --options "" norm_sums+packed --out benchmarks
    python3 experiments/chain_spills.py            # on the GPU itself

`pallas_kernels` comes from the import path as given (the repository root is not added), so a
copy of another tree put first on PYTHONPATH compiles that tree's kernel: before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

# name: (D, F, query heads, kv heads, head_dim)
SHAPES = {"350m": (1024, 2816, 16, 16, 64), "1b": (2048, 5632, 16, 16, 128),
          "llama3.2-1b": (2048, 8192, 32, 8, 64)}


OPTIONS = ("norm_sums", "packed", "head", "state")  # chain_mgpu's boolean options --options may name;
# head: the output layer inside the kernel (w_head, Llama-3's 128,256-row table); state: the words
# kept between calls and x_0 read from the embedding table (state=..., embed=...: the decode
# loop's form, `decoder.plan(kernel_state=True)`). NAME=N sets an integer option (loads=4; steps=8:
# greedy steps a call, with head and state).


def compile_one(name: str, aot: bool, tiles: int, options: str = ""):
    """Compile one shape's kernel in this process (ptxas reports on stderr); options: some of
    `OPTIONS`, "+"-joined, set True; the others are set False (the kernel's defaults are both on)."""
    if aot:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    import jax
    import jax.numpy as jnp

    from pallas_kernels.chain import call as cc
    from pallas_kernels.chain import kernel as cm

    sharding = {}
    if aot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from decode_hlo_h200 import h200_sharding
        sharding = dict(sharding=h200_sharding())
    D, F, NQ, K, hd = SHAPES[name]
    N1 = D + 2 * K * hd

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, **sharding)

    args = (spec((D,), jnp.float32), spec((2, N1, D)), spec((2, D, D)), spec((2, 2 * F, D)), spec((2, D, F)),
            spec((2, 2, K, 320, hd)), spec((1,), jnp.int32), spec((hd,), jnp.float32))
    chosen = set(filter(None, options.split("+")))
    numbers = {k: int(v) for k, eq, v in (c.partition("=") for c in chosen) if eq}
    flags = {o: o in chosen for o in OPTIONS if o not in ("head", "state")}
    opts = dict(blocks=132, norm_eps=1e-5, tiles=tiles, **flags, **numbers)
    extra = {}
    if "head" in chosen:
        extra["w_head"] = spec((128256, D))
    if "state" in chosen:
        extra["embed"] = (spec((128256, D)), spec((1,), jnp.int32))
        head = {k: extra[k] for k in ("w_head",) if k in extra}  # a state's size counts the head's choices
        extra["state"] = spec((cc.state_size(None, *args[1:], **opts, embed=extra["embed"], **head),), jnp.int32)
        args = (None, *args[1:])
        if opts.get("steps", 1) > 1:  # greedy steps move the cache's length on
            opts["advance"] = True
    f = jax.jit(lambda a, e: cc.chain_mgpu(*a, **opts, **e))
    print("kernel:", cm.__file__, flush=True)
    f.trace(args, extra).lower(lowering_platforms=("cuda",)).compile()


def report(text: str) -> dict:
    """ptxas's figures for the chain kernel from its verbose output."""
    used = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    warnings = sorted(set(re.findall(r"\((C75\d\d)\) ([^\n]*?) in (?:the )?function", text)))
    return dict(registers=int(used[-1]) if used else None,
                spill_store_bytes=int(spills[-1][0]) if spills else None,
                spill_load_bytes=int(spills[-1][1]) if spills else None,
                wgmma_serialised="C7520" in text or "are serialized" in text,
                injected_arrives=text.count("(C7519)"),
                warnings=sorted({f"{code} {msg[:90]}" for code, msg in warnings if code != "C7519"}),
                kernel=next((ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith("kernel:")), None))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tiles", nargs="*", type=int, default=[1], help="chain_mgpu(tiles=...) values")
    parser.add_argument("--options", nargs="*", default=[""],
                        help=f"option sets, each compiled: '' (none: each False) or some of {OPTIONS} and "
                             "NAME=N (an integer option: loads=4) joined by +")
    parser.add_argument("--aot", action="store_true", help="deviceless compile for an H200 (no GPU here)")
    parser.add_argument("--out", default=None, help="folder for decode_megakernel_ptxas.json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        name, tiles, options = args.one.split(":")
        return compile_one(name, args.aot, int(tiles), options)
    bad = {o for opts in args.options for o in filter(None, opts.split("+")) if "=" not in o} - set(OPTIONS)
    if bad:
        sys.exit(f"--options: {sorted(bad)} unknown; use some of {OPTIONS} joined by +")
    rows = []
    for name, tiles, options in ((n, t, o) for n in args.shapes for t in args.tiles for o in args.options):
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{name}:{tiles}:{options}"] + ["--aot"] * args.aot
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{name} tiles={tiles} {options}: the compile failed:\n{run.stderr[-3000:]}")
        row = dict(shape=name, tiles=tiles, options=options, **report(run.stdout + run.stderr))
        rows.append(row)
        print(f"{name:12s} tiles={tiles} {options or '-':16s} {row['registers']} registers, spills "
              f"{row['spill_store_bytes']}/{row['spill_load_bytes']} B, wgmma serialised: "
              f"{row['wgmma_serialised']}, arrives added: {row['injected_arrives']}", flush=True)
    if args.out:
        import jax
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "decode_megakernel_ptxas.json")
        with open(path, "w") as f:
            json.dump(dict(jax=jax.__version__, target="H200 (deviceless)" if args.aot else "this GPU",
                           rows=rows), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
