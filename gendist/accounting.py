"""Predicted vs compiled: per-device memory and per-step communication of a train step.

`predict` works from the config and the mesh alone (every array's shard from the
logical-axis table and the ZeRO placement; each collective from Megatron-LM (Shoeybi et
al. 2019), sequence parallelism (Korthikanti et al. 2022) and ZeRO (Rajbhandari et al.
2020)). `compiled` reads the same figures from XLA: state bytes from the compiled step's
output shardings, `memory_analysis()`, and every collective in the optimized HLO with its
shape, mesh axes and loop trip count. `python -m gendist plan` prints both side by side.

Communication is counted as payload bytes per device and step, as `gendist.collectives`
reads it from the compiled module (the full buffer of an all-reduce, the gathered output of
an all-gather, the input of a reduce-scatter).

One backend fact enters the prediction. XLA's GPU compiler runs ReduceScatterCreator and
AllReduceReassociate (gpu_compiler.cc, "collective-optimizations"); the CPU compiler does
not. So on CPU a reduce-scatter stays an all-reduce followed by a slice, and each
column-parallel matmul's input gradient is all-reduced on its own (q, k, v, gate, up:
five per layer instead of Megatron's one per f operator, and two for a tied embedding).
`fused=None` picks by backend; the Megatron/ZeRO ideal is `fused=True`.
"""

from __future__ import annotations

import math

import numpy as np

from gendist.collectives import comm_table, parse_collectives
from gendist.models import fp8 as fp8_lib
from gendist.models import transformer
from gendist.parallel.pipeline import pipedream, terapipe
from gendist.parallel.pipeline import schedules as sched_lib
from gendist.parallel.pipeline import stats as stats_lib
from gendist.parallel.zero import model_for_stage
from gendist.sharding import logical_to_spec
from gendist.training import train

# --- predictions from the config and the mesh -----------------------------------------------

def _shard_bytes(struct, sharding, itemsize=None) -> int:
    itemsize = struct.dtype.itemsize if itemsize is None else itemsize
    return itemsize * math.prod(sharding.shard_shape(tuple(struct.shape)))


def _param_rows(setup):
    """(path, shape struct, logical axes, stored/compute/grad sharding) for every param."""
    import jax
    from jax.sharding import NamedSharding

    axes = transformer.logical_axes(setup.cfg.model)
    shapes = setup.abstract_state()["params"]
    flat_axes = dict(jax.tree_util.tree_leaves_with_path(
        axes, is_leaf=lambda a: isinstance(a, tuple)))
    g_sh = dict(jax.tree_util.tree_leaves_with_path(setup.grad_sharding))
    rows = []
    for path, s in jax.tree_util.tree_leaves_with_path(shapes):
        names = flat_axes[path]
        compute = NamedSharding(setup.mesh, logical_to_spec(names, mesh=setup.mesh))
        rows.append((jax.tree_util.keystr(path), s, names, s.sharding, compute, g_sh[path]))
    return rows


def predict(setup, backend: str | None = None) -> dict:
    """Per-device memory (bytes) and per-step communication ((kind, axes) -> bytes).

    `backend` ("cpu", "gpu", ...; default: this process's) decides the two compiler facts
    of the module docstring; anything but "cpu" gets the Megatron/ZeRO ideal.
    """
    import jax
    cfg, mesh = setup.cfg, setup.mesh
    m, t = cfg.model, cfg.train
    cpu = (backend or jax.default_backend()) == "cpu"
    fused = not cpu
    c = 2 if m.dtype == "bfloat16" else 4
    cc = 4 if cpu else c  # XLA:CPU runs 16-bit collectives in fp32 (float normalization)
    tp, dp, stage, acc = mesh.shape["tensor"], mesh.shape["data"], t.zero_stage, t.grad_accum
    sp = cfg.mesh.sequence_parallel and tp > 1
    bl = t.batch_size // (dp * mesh.shape["expert"]) // acc
    tokens, L, D = bl * t.seq_len, m.num_layers, m.d_model
    state = setup.abstract_state()
    rows = _param_rows(setup)
    mem = {"params": sum(_shard_bytes(s, st) for _, s, _, st, _, _ in rows),
           "optimizer state": sum(_shard_bytes(s, s.sharding)
                                  for s in jax.tree.leaves(state["opt_state"])),
           "gradients": sum(_shard_bytes(s, g) for _, s, _, _, _, g in rows)}
    batch = 2 * 4 * t.batch_size // (dp * mesh.shape["expert"]) * t.seq_len
    mem["arguments (state + batch)"] = mem["params"] + mem["optimizer state"] + 4 + batch
    # The compute copy: the whole model (stages 1-2, or bf16 casts), or ZeRO-3's one
    # gathered layer (two in flight) plus the embedding and final norm.
    copy = [_shard_bytes(s, cs, c if len(s.shape) >= 2 else 4) for _, s, _, _, cs, _ in rows]
    blocks = sum(b for b, r in zip(copy, rows, strict=True) if "blocks" in r[0])
    whole = stage in (1, 2) or (stage == 0 and c != 4)
    mem["compute copy"] = sum(copy) if whole else (
        sum(copy) - blocks + 2 * blocks // L if stage == 3 else 0)
    copy = [b // c * cc if len(r[1].shape) >= 2 else b for b, r in zip(copy, rows, strict=True)]
    mem["activations (estimate)"] = _activation_bytes(cfg, tp, sp, tokens, c, stage)
    if "fp8" in state:  # FP8 products' amax histories, replicated but for the layers axis
        mem["FP8 scaling state"] = sum(_shard_bytes(h, h.sharding)
                                       for h in jax.tree.leaves(state["fp8"]))
        mem["arguments (state + batch)"] += mem["FP8 scaling state"]
    comm: dict[tuple[str, str], float] = {}

    def add(kind, axis, nbytes):
        comm[(kind, axis)] = comm.get((kind, axis), 0) + nbytes

    act = tokens * D * cc
    if tp > 1 and sp and t.tp_comm == "collective":  # the blocks' f and g as ppermute rings
        rings = 8 + (2 if remat_of(cfg) != "none" else 0) + (2 if remat_of(cfg) == "full" else 0)
        add("collective-permute", "tensor", acc * L * rings * act * (tp - 1) / tp)
        add("all-gather", "tensor", acc * 2 * act)  # output layer's f, embedding's backward
        add("reduce-scatter", "tensor", acc * 2 * act)  # explicit (psum_scatter) here
        add("all-reduce", "tensor", acc * 3 * tokens * 4)  # the vocabulary-parallel loss
        add("all-reduce", "tensor", acc * (2 * L + 1) * D * 4)  # norm scales' gradients
    elif tp > 1:  # Megatron: f and g per block; vocab-parallel embedding, output layer, loss
        red = "reduce-scatter" if sp and fused else "all-reduce"
        col_bwd = 2 if fused else 3 + (2 if m.mlp == "swiglu" else 1)
        add(red, "tensor", acc * L * (2 + col_bwd) * act + acc * act)
        add("all-reduce", "tensor", acc * tokens * D * (4 if stage == 0 else cc))
        add("all-reduce", "tensor", acc * 3 * tokens * 4)
        if sp:  # + the embedding's backward gathers its gradient's sequence shards
            add("all-gather", "tensor", acc * (4 * L + 2) * act)
            if remat_of(cfg) != "none":  # the backward recomputes each f's all-gather
                add("all-gather", "tensor", acc * 2 * L * act)
            if remat_of(cfg) == "full":  # ... and each g's reduction
                add(red, "tensor", acc * 2 * L * act)
            add("all-reduce", "tensor", acc * (2 * L + 1) * D * 4)
    if dp > 1:  # one reduction of every gradient; ZeRO's gathers of the compute copy
        red = "reduce-scatter" if stage >= 2 and fused else "all-reduce"
        for (path, s, _, stored, compute, _), nbytes in zip(rows, copy, strict=True):
            local = nbytes // (cc if len(s.shape) >= 2 else 4)
            if path == "['embed']" and m.tie_embeddings and not fused:
                add(red, "data", acc * local * ((4 if stage == 0 else cc) + cc))
            else:
                add(red, "data", acc * local * (4 if len(s.shape) < 2 else cc))
            if stage >= 1 and stored.shard_shape(s.shape) != compute.shard_shape(s.shape):
                add("all-gather", "data", nbytes * (2 * acc if stage == 3 and "blocks" in path
                                                     else 1))
    ep = mesh.shape["expert"]
    if m.num_moe_layers and ep > 1:  # GShard: dispatch and combine, forward and backward
        buf = m.moe_experts * m.moe_capacity(tokens) * D * cc
        add("all-to-all", "expert", acc * 4 * m.num_moe_layers * buf)
        if dp == 1:  # the weights not split over experts: one gradient all-reduce
            add("all-reduce", "expert", acc * sum(
                b // (cc if len(r[1].shape) >= 2 else 4) * (4 if len(r[1].shape) < 2 else cc)
                for b, r in zip(copy, rows, strict=True) if "expert" not in str(r[3].spec)))
    assumes = ("XLA:CPU: no reduce-scatter/reassociation, fp32 collectives" if cpu else
               "Megatron/ZeRO ideal: fused reductions, collectives in model.dtype")
    return {"memory": mem, "comm": comm, "assumes": assumes}


def remat_of(cfg) -> str:
    """The recomputation the step runs (ZeRO-3 turns 'none' into 'save_matmuls')."""
    return model_for_stage(cfg.model, cfg.train.zero_stage).remat


def _activation_bytes(cfg, tp, sp, tokens, c, stage) -> int:
    """Saved activations of one step's backward, per device: a rough count, not XLA's."""
    m = cfg.model
    D, H, F, T = m.d_model, m.head_dim, m.d_ff, cfg.train.seq_len
    qkv = (m.num_heads + 2 * m.num_kv_heads) * H / tp
    mlp_h = (3 if m.mlp == "swiglu" else 2) * F / tp
    remat = remat_of(cfg)
    if remat == "full":
        per_token = D / (tp if sp else 1) * c
    elif remat == "save_matmuls":
        per_token = (qkv + m.num_heads * H / tp + mlp_h + 2 * D) * c
    else:
        resid = 2 * D / (tp if sp else 1) + 2 * D
        per_token = (resid + 2 * qkv + m.num_heads * H / tp + mlp_h) * c
        per_token += m.num_heads / tp * T * 4  # softmax probabilities, fp32
    logits = 2 * m.vocab_size / tp * 4
    return int(tokens * (m.num_layers * per_token + logits))


def compiled_figures(setup) -> dict:
    """The same figures read from XLA: output shardings, memory_analysis and the HLO."""
    import jax
    t = setup.cfg.train
    dpo = t.objective == "dpo"  # 2 rows a preference pair, and the response mask
    rows = t.batch_size * (2 if dpo else 1)
    batch = {k: jax.ShapeDtypeStruct((rows, t.seq_len), np.float32 if k == "mask" else np.int32,
                                     sharding=setup.batch_sharding)
             for k in ("inputs", "targets", *(("mask",) if dpo else ()))}
    state = setup.abstract_state()
    compiled = setup.step_fn.lower(state, batch).compile()
    out_state = compiled.output_shardings[0]
    ma = compiled.memory_analysis()

    def nbytes(key):
        return sum(_shard_bytes(s, sh) for s, sh in zip(
            jax.tree.leaves(state[key]), jax.tree.leaves(out_state[key]), strict=True))

    mem = {"params": nbytes("params"), "optimizer state": nbytes("opt_state"),
           **{name: nbytes(key) for key, name in (("base", "frozen base (LoRA)"),
                                                  ("reference", "DPO reference"))
              if key in state},
           "arguments (state + batch)": ma.argument_size_in_bytes,
           "temp (XLA)": ma.temp_size_in_bytes}
    colls = parse_collectives(compiled.as_text(), setup.mesh)
    return {"memory": mem, "comm": comm_table(colls), "collectives": colls,
            "compiled": compiled}


def bubble_lines(cfg, mesh=None) -> list[str]:
    """The bubble (from the static table) and what a stage holds, for the pipeline engine
    this config runs (pipeline > 1): a schedule's in-flight microbatches, PipeDream's weight
    versions, TeraPipe's K/V cache."""
    p = cfg.mesh.pipeline
    if p <= 1:
        return []
    t, m_cfg = cfg.train, cfg.model
    m = t.pipeline_microbatches or 2 * p
    if t.terapipe_slices:
        k = t.terapipe_slices
        sched = terapipe.terapipe_schedule(p, k)
        shards = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in ("data", "expert")]))
        tp = 1 if mesh is None else mesh.shape["tensor"]
        layers = m_cfg.num_layers // p
        kv = 2 * layers * (t.batch_size // shards) * t.seq_len * (m_cfg.num_kv_heads // tp) \
            * m_cfg.head_dim
        bytes_kv = kv * (2 if m_cfg.dtype == "bfloat16" else 4) + kv * 4  # cache + fp32 grad
        return [f"TeraPipe: p={p} stages, {k} token slices of "
                f"{terapipe.equal_slices(t.seq_len, k)} tokens, {sched.num_steps} steps",
                f"  bubble (table): {stats_lib.bubble_fraction(sched):.4f}",
                f"  K/V cache + its gradient per stage: {_mb(bytes_kv).strip()}"]
    if t.pipeline_schedule in ("pipedream", "pipedream-nostash", "2bw"):
        mode = {"pipedream": "stash", "pipedream-nostash": "nostash", "2bw": "2bw"}[
            t.pipeline_schedule]
        window = (t.pipedream_window or max(1, p - 1)) if mode == "2bw" else 1
        sched = sched_lib.make("1f1b", p, m)
        plan = pipedream.version_plan(sched, mode, window)
        stage_params = m_cfg.num_params / p
        return stats_lib.pipeline_plan_lines(p, m, sched)[:1] + [
            f"  PipeDream ({mode}): no flush; {plan.num_updates} updates per stage per step",
            f"  weight versions stored per stage: {plan.num_slots} (~"
            f"{_mb(plan.num_slots * stage_params * 4).strip()} of fp32 weights per stage)"]
    return stats_lib.pipeline_plan_lines(p, m, t.pipeline_schedule, t.pipeline_chunks)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:10.3f} MiB" if x >= 2**20 else f"{x / 2**10:10.2f} KiB"


def plan_report(cfg, compile_step: bool = True) -> str:
    """Predicted (and compiled) memory and communication for a config, as a text table."""
    setup = train.build(cfg)
    if setup.mesh.shape["pipeline"] > 1:  # the model below covers the non-pipelined step
        pred = {"memory": {}, "comm": {}, "assumes": "no prediction for pipelined steps yet"}
    elif cfg.train.lora_rank or cfg.train.objective == "dpo":
        pred = {"memory": {}, "comm": {},
                "assumes": "no prediction for LoRA or DPO steps yet"}
    else:
        pred = predict(setup)
    comp = compiled_figures(setup) if compile_step else {"memory": {}, "comm": {}}
    mesh = dict(setup.mesh.shape)
    lines = [f"mesh {mesh}, sequence_parallel={cfg.mesh.sequence_parallel}, "
             f"zero_stage={cfg.train.zero_stage}, model {cfg.model.params_text()}, "
             f"dtype {cfg.model.dtype}",
             f"{'memory per device':34s} {'predicted':>14s} {'compiled':>14s}"]
    keys = list(pred["memory"]) + [k for k in comp["memory"] if k not in pred["memory"]]
    for k in keys:
        lines.append(f"  {k:32s} {_mb(pred['memory'].get(k)):>14s} "
                     f"{_mb(comp['memory'].get(k)):>14s}")
    lines.append(f"{'communication per step per device':34s} {'predicted':>14s} "
                 f"{'compiled':>14s}   (payload bytes; {pred['assumes']})")
    for kind, axes in sorted(set(pred["comm"]) | set(comp["comm"])):
        p, c = pred["comm"].get((kind, axes)), comp["comm"].get((kind, axes))
        lines.append(f"  {kind + ' over ' + axes:32s} {_mb(p):>14s} {_mb(c):>14s}")
    return "\n".join(lines + fp8_lines(cfg) + bubble_lines(cfg, setup.mesh))


DENSE_PEAKS = {"bf16": 989e12, "fp8": 1979e12}  # H100/H200 SXM, dense (NVIDIA datasheet)


def fp8_lines(cfg) -> list[str]:
    """FP8's share of the step's FLOPs and the speedup it allows at Hopper's peaks."""
    if cfg.train.matmul_precision != "fp8":
        return []
    m, T = cfg.model, cfg.train.seq_len
    share = fp8_lib.product_flops_per_token(m) / m.flops_per_token(T)
    bound = fp8_lib.ideal_speedup(m, T, DENSE_PEAKS["bf16"], DENSE_PEAKS["fp8"])
    return [f"FP8 products: {share:.1%} of the step's FLOPs; at Hopper's dense peaks (bf16 "
            f"989, FP8 1979 TFLOP/s) the step is at most {bound:.2f}x the bf16 step"]

