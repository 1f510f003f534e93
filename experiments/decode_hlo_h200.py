"""The decode loop as XLA compiles it for an H200, on a machine without a GPU: kernels per step.

XLA can compile for a GPU it does not have (deviceless ahead-of-time compilation through a
PJRT topology with a target config), so the fused HLO that the H200 would run can be read
on a CPU-only machine: how many kernels one decode step launches, of which kinds, and
whether a step copies the KV cache or materialises a matrix-sized product. This is how the
fast path's layout choices were made (benchmarks/decode.md, docs/decisions.md); the times need the GPU
(`decode_floor.py`).

Setup (once; the CUDA plugin of the installed jax version, without its CUDA libraries):

    pip install --no-deps --target /tmp/cuda_aot jax-cuda13-pjrt==$JAXVER jax-cuda13-plugin==$JAXVER
    PYTHONPATH=.:/tmp/cuda_aot JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python experiments/decode_hlo_h200.py --cases 350m:1:fast 350m:1:reference --out benchmarks

Speculative cases, `spec:<target>:<width>x<layers>:<gamma>:<options>`: `speculative_generate` with a
`draft_config` draft, compiled with the options it picks (`program`), `stacked`
(`decoder.STACKED_PROMPT_OPTIONS`) or `defaults` (XLA's); `slice_copies_MB_per_step`: what a step
copies out of stacked weights (the draft's scan over its layers).

Variants: `reference` (stacked weights, one stacked cache, the layer scan unrolled), `fast`
(the decode layout, per-layer cache, the fused decode kernels: RMSNorm, RoPE + cache write
+ attention), `fast@<tiling>` (fast with the attention kernel tiled as `LayerKVCache.tiling`
says, e.g. `fast@bk128_sp1_w4_st3`), `fast_unfused` (fast without the fused kernels: XLA's norms and RoPE, the
paged kernel), `fast_xla` (fast with jnp attention over all max_len slots), `chain` (the
megakernel path at batch 1; `chain+xla`, `chain+fused`: its output layer in XLA or inside
the kernel, none: `decoder.plan`'s default; `+state`: the kernel keeps its words between
steps and writes the cache, `decoder.plan(kernel_state=True)`). (`decode_hlo_h200_fold.json` came from a `fast` that folded the
norms' gains into the next matrices, an option since removed: docs/decisions.md.)

Autotuning needs a device, so GEMM configurations (batch > 1) are XLA's defaults, not what
the GPU would pick; fusion decisions, reductions and copies are the GPU's. Pallas kernels
are lowered for sm90 (Mosaic GPU for decode attention) by telling their dispatch that an
H200 is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import time
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

H200 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150000000000
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def h200_sharding():
    """A replicated sharding on one H200 that is not here: arrays given it compile deviceless
    for that GPU (a PJRT topology with the target config above)."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _pretend_h200():
    """Make the Pallas dispatch lower for an H200 in this GPU-less process."""
    try:  # jax 0.11: Triton's own copy; newer: jax._src.gpu_info
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        from jax._src import gpu_info
    from jax._src.pallas.triton import pallas_call_registration as triton_call

    import pallas_kernels.decode_attention as da_kernel
    import pallas_kernels.paged_attention as pa_kernels
    import pallas_kernels.prompt_attention as prompt_kernel
    import pallas_kernels.rms_norm as norm_kernel
    h100 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)  # sm90: what Triton reads
    triton_call.gpu_info_lib.get_gpu_info = lambda: h100
    for mod in (da_kernel, norm_kernel, prompt_kernel):  # their `interpret=None` would see a CPU backend
        mod.resolve_interpret = lambda interpret: bool(interpret)
    gpu_info.get_device_kind = lambda: "NVIDIA H200"
    pa_kernels.on_sm90 = lambda: True
    resolve = pa_kernels._resolve
    pa_kernels._resolve = lambda sm, hd, interpret: (resolve(sm, hd, interpret)[0], False)


def compiled(fn, args, kwargs, hlo_dir: str | None, stem: str) -> tuple[str, float]:
    """(HLO text, seconds) of `fn` compiled for greedy decoding with these arguments; the text
    also written to `hlo_dir`/`stem`.hlo.txt when asked."""
    from gendist.inference.sampling import SamplingParams
    t0 = time.perf_counter()
    text = fn.lower(*args, sp=SamplingParams(temperature=0.0), **kwargs).compile().as_text()
    seconds = time.perf_counter() - t0
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / f"{stem}.hlo.txt").write_text(text)
    return text, seconds


def compile_case(name: str, batch: int, variant: str, prompt: int, new: int, rep,
                 hlo_dir: str | None = None):
    from gendist import profiling
    from gendist.inference import decoder
    from gendist.inference.generate import generate
    from gendist.models import transformer
    from gendist.presets import preset

    cfg = preset(name).model
    S = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    raw = jax.eval_shape(lambda: transformer.init_params(cfg, 0))
    base, *flags = variant.split("+")
    head = next((f for f in flags if f != "state"), None)
    kind, _, tiling = base.partition("@")
    if kind == "chain":
        opts = dict(path="megakernel", kernel_state="state" in flags, **(dict(head=head) if head else {}))
    elif kind == "reference":
        cfg = dataclasses.replace(cfg, scan_unroll=cfg.num_layers)
        opts = dict(path="reference")
    else:
        opts = dict(path="fast", backend="xla" if kind == "fast_xla" else "pallas",
                    fused=kind != "fast_unfused", tiling=tiling)
    plan = jax.eval_shape(lambda p: decoder.plan(cfg, p, batch, prompt + new,
                                                 device=("gpu", "NVIDIA H200"), **opts), raw)
    cache = jax.tree.map(S, jax.eval_shape(plan.make_cache))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    args = (jax.tree.map(S, plan), S(jnp.zeros((batch, prompt), jnp.int32)),
            S(jnp.zeros((batch,), jnp.int32)), key)
    text, seconds = compiled(generate, args, dict(max_new_tokens=new, cache=cache), hlo_dir,
                             f"{name}_{batch}_{variant}")
    kinds = profiling.loop_body_kinds(text)
    return dict(preset=name, batch=batch, variant=variant, compile_s=seconds,
                kernels_per_step=kinds, total=sum(kinds.values()),
                per_layer=sum(kinds.values()) / preset(name).model.num_layers,
                written_MB_per_step=written_bytes(text) / 1e6,
                slice_copies_MB_per_step=slice_copy_bytes(text) / 1e6)


def compile_speculative_case(target: str, draft: str, gamma: int, options: str, prompt: int,
                             new: int, rep, hlo_dir: str | None = None):
    """A speculative program (`speculative_generate`: target `target` verifying gamma + 1
    tokens on its plan's path, a `draft` = "<width>x<layers>" draft on its own, batch 1,
    greedy) compiled with `options`: "program" (those `speculative_generate` picks for its
    paths), "stacked" (`decoder.STACKED_PROMPT_OPTIONS`) or "defaults" (XLA's)."""
    from gendist import profiling
    from gendist.inference import decoder, speculative
    from gendist.inference.lm import draft_config, transformer_lm
    from gendist.models import transformer
    from gendist.presets import preset

    S = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    tm = preset(target).model
    width, layers = (int(v) for v in draft.split("x"))
    n_max = prompt + new + gamma + 1

    def plan(cfg, **kw):
        raw = jax.eval_shape(lambda: transformer.init_params(cfg, 0))
        return jax.eval_shape(lambda p: decoder.plan(cfg, p, 1, n_max, device=("gpu", "NVIDIA H200"),
                                                     **kw), raw)

    verify, small = plan(tm, step_tokens=gamma + 1), plan(draft_config(tm, width, layers))
    t_lm, d_lm = transformer_lm(verify, "target"), transformer_lm(small, "draft")
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    args = (t_lm, jax.tree.map(S, verify.params), d_lm, jax.tree.map(S, small.params),
            S(jnp.zeros((1, prompt), jnp.int32)), S(jnp.zeros((1,), jnp.int32)), key)
    paths = {"program": speculative.program_paths(t_lm, d_lm), "stacked": ("megakernel",),
             "defaults": ()}[options]  # the paths whose XLA options the program compiles with
    variant = f"speculative {draft} draft g{gamma} {options}"
    text, seconds = compiled(speculative.speculative_generate.for_paths(*paths), args,
                             dict(max_new_tokens=new, spec=speculative.SpecConfig(gamma=gamma)),
                             hlo_dir, f"{target}_{variant.replace(' ', '_')}")
    kinds = profiling.loop_body_kinds(text)
    return dict(preset=target, batch=1, variant=variant, paths=[verify.path, small.path],
                options=decoder.compiler_options(*paths),
                compile_s=seconds, kernels_per_step=kinds, total=sum(kinds.values()),
                slice_copies_MB_per_step=slice_copy_bytes(text) / 1e6)


def slice_copy_bytes(text: str) -> int:
    """Bytes one step of the decode loop (the entry's last loop) copies out of stacked arrays:
    XLA's dynamic-slice copies (`fused_dynamic_slice` fusions, a kernel or memcpy each) in its
    body and the loops nested in it, times their known trip counts. cuBLAS reading a slice in
    place (a `dynamic-slice-fusion` custom fusion) copies nothing."""
    from gendist import profiling
    comps = profiling.parse_hlo(text)
    entry = profiling.entry_computation(text)

    def root_bytes(comp):
        line = next(ln for _, _, ln in comps[comp] if "ROOT" in ln)
        return array_bytes(*re.search(r"=\s*(\w+)\[([\d,]*)\]", line).groups())

    def per_trip(body):
        total = 0
        for _, op, line in comps.get(body, ()):
            if op in ("fusion", "fusion-start") and (m := re.search(r"calls=%(fused_dynamic_slice[\w.\-]*)", line)):
                total += root_bytes(m.group(1))
            elif op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                total += (int(trips.group(1)) if trips else 1) * per_trip(
                    re.search(r"body=%([\w.\-]+)", line).group(1))
        return total

    loops = [re.search(r"body=%([\w.\-]+)", line).group(1)
             for _, op, line in comps.get(entry, ()) if op == "while"]
    return per_trip(loops[-1]) if loops else 0


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def array_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array type `dtype[dims]` ("bf16", "2048,64")."""
    return math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)


def written_bytes(text: str) -> int:
    """Bytes the loop body's kernels write per step (their outputs), not counting in-place
    row updates (dynamic-update-slice and scatter fusions write a row, not their shape)."""
    from gendist import profiling
    bodies = set(re.findall(r"while\(.*?body=%([\w.\-]+)", text))
    comps = profiling.parse_hlo(text)
    best = 0
    for body in bodies:
        total = 0
        for _, _, line in comps.get(body, ()):
            m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+"
                         r"(fusion|custom-call|copy)\(", line)
            if not m or "dynamic_update_slice" in m.group(1) or "scatter" in m.group(1):
                continue
            # Outputs aliased to an operand (a kernel's in-place cache update) write a row.
            aliased = {int(i) for i in re.findall(r"\{(\d+)\}:\s*\(", line.split(
                "output_to_operand_aliasing=", 1)[1])} if "output_to_operand_aliasing" in line else set()
            for j, (dt, dims) in enumerate(re.findall(r"(\w+)\[([\d,]*)\]", m.group(2))):
                if j in aliased:
                    continue
                total += array_bytes(dt, dims)
        best = max(best, total)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["350m:1:reference", "350m:1:fast",
                                                   "1b:64:reference", "1b:64:fast"])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"))
    ap.add_argument("--name", default="decode_hlo_h200.json", help="the JSON's file name")
    ap.add_argument("--hlo-dir", default=None,
                    help="also write each case's compiled HLO text here (to read the fusions)")
    args = ap.parse_args()
    rep = h200_sharding()
    _pretend_h200()
    rows = []
    for spec in args.cases:
        if spec.startswith("spec:"):
            _, name, draft, gamma, options = spec.split(":")
            row = compile_speculative_case(name, draft, int(gamma), options, args.prompt,
                                           args.new_tokens, rep, args.hlo_dir)
        else:
            name, batch, variant = spec.split(":")
            row = compile_case(name, int(batch), variant, args.prompt, args.new_tokens, rep,
                               args.hlo_dir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps(
        dict(jax=jax.__version__, target="H200 (deviceless compile)", prompt=args.prompt,
             new_tokens=args.new_tokens, cases=rows), indent=1))


if __name__ == "__main__":
    main()
