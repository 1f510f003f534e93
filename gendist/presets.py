"""Named presets and the override machinery over the typed configs of `gendist.config`:
`preset(name)`, `replace(cfg, **{"model.d_model": 64})` (dotted paths) and
`config_from_dict` (a saved `dataclasses.asdict(Config)` back to a `Config`).
"""

from __future__ import annotations

import dataclasses

from gendist.config import (
    Config,
    DataConfig,
    GenerateConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
)


def _model(**kw) -> ModelConfig:
    return ModelConfig(**kw)


# Named presets. Widths follow GPT-2 / Pythia-style shapes with head_dim 64 or 128.
PRESETS: dict[str, Config] = {
    # CPU: 4 layers, width 128 (~0.8M params); trains to < 2.2 nats/byte in minutes on 2 cores.
    "tiny": Config(),
    # ~25M params.
    "small": Config(
        model=_model(d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64,
                     d_ff=1408, max_seq_len=1024, dtype="bfloat16", attention="cudnn"),
        train=TrainConfig(batch_size=32, seq_len=512, lr=1e-3, steps=2000)),
    # GPT-2 small shape (124M with its 50k vocabulary; bytes make it ~85M).
    "gpt2": Config(
        model=_model(d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                     d_ff=2048, max_seq_len=2048, dtype="bfloat16", attention="cudnn"),
        train=TrainConfig(batch_size=32, seq_len=1024, lr=6e-4, steps=2000)),
    # GPT-2 medium shape.
    "350m": Config(
        model=_model(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64,
                     d_ff=2816, max_seq_len=2048, dtype="bfloat16", attention="cudnn"),
        train=TrainConfig(batch_size=16, seq_len=1024, lr=3e-4, steps=2000)),
    # ~1.2B params, head_dim 128 (Llama-style). The layer scan is unrolled: on an H200 that
    # took the step from 45.6% to 54.8% MFU and halved its temp memory (benchmarks/training.md).
    "1b": Config(
        model=_model(d_model=2048, num_layers=22, num_heads=16, num_kv_heads=16, head_dim=128,
                     d_ff=5632, max_seq_len=2048, dtype="bfloat16", attention="cudnn",
                     scan_unroll=22),
        train=TrainConfig(batch_size=8, seq_len=2048, lr=2e-4, steps=2000)),
    # Llama-3-8B's shape (Meta 2024: 32 layers, width 4096, 32 query / 8 kv heads of 128,
    # SwiGLU 14336) with the byte vocabulary: 6.98B parameters. At ~18 bytes a parameter
    # (fp32 master, gradients, Adam m and v, bf16 compute copy) its training state is
    # ~126 GB before activations: it needs pipeline stages (mesh.pipeline=2 on two H200s).
    # Layers rematerialised; the layer scan stays rolled (compile time).
    "8b": Config(
        model=_model(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     d_ff=14336, max_seq_len=2048, dtype="bfloat16", attention="cudnn",
                     remat="full", tie_embeddings=False),
        mesh=MeshConfig(pipeline=2),
        train=TrainConfig(batch_size=16, seq_len=2048, lr=1.5e-4, steps=2000,
                          pipeline_microbatches=16)),
    # Llama-3.2-1B's shape (its config.json: 16 layers, width 2048, 32 query / 8 kv heads of
    # 64, SwiGLU 8192, vocabulary 128256, tied embeddings, RoPE theta 500000 with llama3
    # scaling (32, 1, 4, 8192), RMSNorm eps 1e-5): 1.24B parameters, random weights here
    # (a decode benchmark's shape; real weights load through `gendist.hf`).
    "llama3.2-1b": Config(
        model=_model(d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     d_ff=8192, vocab_size=128256, max_seq_len=2048, dtype="bfloat16",
                     attention="cudnn", rope_theta=500_000.0, rope_scaling="llama3",
                     rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_len=8192, norm_eps=1e-5, scan_unroll=16),
        train=TrainConfig(batch_size=8, seq_len=2048, lr=2e-4, steps=2000)),
    # 350m's shape with an MoE FFN in every 2nd block (8 experts, top-2, GShard): ~1.0B
    # parameters, 0.41B active per token; `plan`: 15.4 GiB of state + compute copy and ~38 GiB
    # of activations at batch 16 x 1024 (estimate), so it fits one H200 (the
    # 1b shape with the same MoE is ~3.8B, ~68 GB of state before activations).
    "350m-moe": Config(
        model=_model(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64,
                     d_ff=2816, max_seq_len=2048, dtype="bfloat16", attention="cudnn",
                     moe_experts=8, moe_top_k=2, moe_every=2),
        train=TrainConfig(batch_size=16, seq_len=1024, lr=3e-4, steps=2000)),
}


def preset(name: str) -> Config:
    """A named preset; raises with the list of names on a typo."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; pass --preset with one of "
                         f"{', '.join(PRESETS)}.")
    return PRESETS[name]


def replace(cfg, **changes):
    """dataclasses.replace that also accepts dotted paths: replace(cfg, **{"model.d_model": 64})."""
    nested: dict[str, dict] = {}
    flat = {}
    for k, v in changes.items():
        head, _, rest = k.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            flat[k] = v
    for head, sub in nested.items():
        flat[head] = replace(getattr(cfg, head), **sub)
    return dataclasses.replace(cfg, **flat)


def config_from_dict(d: dict) -> Config:
    """Inverse of dataclasses.asdict(Config) (as saved in checkpoint metadata)."""
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    kw = {}
    for name, sub in d.items():
        cls = {"model": ModelConfig, "mesh": MeshConfig, "data": DataConfig,
               "train": TrainConfig, "generate": GenerateConfig}[name]
        known = {f.name for f in dataclasses.fields(cls)}
        kw[name] = cls(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in sub.items() if k in known})
    del sections
    return Config(**kw)
