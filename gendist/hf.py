"""Llama-architecture checkpoints in the Hugging Face layout, in and out.

A model directory holds `config.json` and `model.safetensors` (or shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`), usually beside its
tokenizer. Supported: `LlamaForCausalLM`, which covers Llama 2, 3, 3.1, 3.2, TinyLlama,
SmolLM/SmolLM2 and other Llama-shaped models: grouped-query attention, RoPE θ, Llama-3 RoPE
scaling, tied or untied embeddings, RMSNorm ε, an explicit `head_dim`. Refused, with the
reason (`UNSUPPORTED`): attention/MLP biases, activations other than SiLU, other RoPE
scalings (linear, dynamic, YaRN, LongRoPE), and other architectures.

The weight mapping is a reshape, with no permutation: HF's Llama applies RoPE to the halves
(x[:H/2], x[H/2:]) of each head (`rotate_half`), the layout `models.layers.apply_rope` uses
(Meta's interleaved checkpoints are permuted into it by HF's conversion script). A Linear
weight is [out, in]; gendist stores [in, out] with heads split out:

    HF (per layer i)                       gendist (stacked on `layers`)
    model.embed_tokens.weight [V, D]       embed [V, D]
    input_layernorm.weight [D]             blocks.attn_norm [L, D]
    self_attn.q_proj.weight [N·H, D]       blocks.wq [L, D, N, H]
    self_attn.k_proj / v_proj [K·H, D]     blocks.wk / wv [L, D, K, H]
    self_attn.o_proj.weight [D, N·H]       blocks.wo [L, N, H, D]
    post_attention_layernorm.weight [D]    blocks.mlp_norm [L, D]
    mlp.gate_proj / up_proj [F, D]         blocks.w_gate / w_up [L, D, F]
    mlp.down_proj.weight [D, F]            blocks.w_down [L, F, D]
    model.norm.weight [D]                  final_norm [D]
    lm_head.weight [V, D] (untied only)    head [D, V]

Loading goes one parameter at a time straight onto its sharding (`shardings`, e.g. from
`optim.state_shardings` for ZeRO or the logical-axis table), via
`jax.make_array_from_callback`: each process places only its own devices' slices.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from gendist.config import ModelConfig
from gendist.data import staging
from gendist.models import transformer
from gendist.parallel import zero

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
SUPPORTED = ("LlamaForCausalLM",)
UNSUPPORTED = {
    "MistralForCausalLM": "sliding-window attention",
    "MixtralForCausalLM": "HF's sparse MoE block (gendist's MoE layout differs)",
    "Qwen2ForCausalLM": "biases on the q/k/v projections",
    "Qwen3ForCausalLM": "RMSNorm on queries and keys",
    "GemmaForCausalLM": "RMSNorm scale (1 + w), GeGLU and a scaled embedding",
    "Gemma2ForCausalLM": "logit soft-capping, sliding windows and extra norms",
    "PhiForCausalLM": "parallel attention/MLP, LayerNorm, partial RoPE",
    "Phi3ForCausalLM": "fused qkv/gate-up projections and LongRoPE",
    "GPT2LMHeadModel": "learned positions, LayerNorm and biases",
    "GPTNeoXForCausalLM": "parallel residual, LayerNorm and partial RoPE",
    "OlmoForCausalLM": "non-parametric LayerNorm",
}
# Fields that describe how gendist runs a model rather than the model itself: these come
# from the caller's ModelConfig, everything else from config.json.
RUNTIME_FIELDS = ("dtype", "attention", "remat", "scan_unroll", "fused_projections")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint whose architecture or options gendist cannot represent exactly."""


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has no {CONFIG}: give a Hugging Face model "
                                "directory (config.json + *.safetensors).")
    return json.loads(path.read_text())


def model_config_from_hf(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig of a Llama `config.json`; runtime fields (dtype, attention backend,
    remat, scan unroll, fused projections) come from `base`."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED or hf.get("model_type", "llama") != "llama":
        why = UNSUPPORTED.get(arch, "not a Llama-architecture model")
        raise UnsupportedCheckpoint(
            f"architecture {arch!r} (model_type {hf.get('model_type')!r}) is not supported: "
            f"{why}. gendist loads {', '.join(SUPPORTED)} checkpoints (Llama 2/3/3.1/3.2, "
            "TinyLlama, SmolLM2 and other Llama-shaped models).")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise UnsupportedCheckpoint(f"config.json has {key}={hf[key]!r}; gendist's Llama "
                                        f"needs {key}={ok!r}.")
    rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps θ and scaling here
    rope.update(hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise UnsupportedCheckpoint(
            f"config.json asks for RoPE scaling {kind!r}; gendist implements the plain "
            "rotation and Llama 3.1's 'llama3' scaling only.")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    base = ModelConfig() if base is None else base
    kw = dict(
        vocab_size=hf["vocab_size"], d_model=d, num_layers=hf["num_hidden_layers"],
        num_heads=n, num_kv_heads=hf.get("num_key_value_heads") or n,
        head_dim=hf.get("head_dim") or d // n, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", base.max_seq_len), mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10_000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", base.init_std)))
    if kind == "llama3":
        kw.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                  rope_low_freq_factor=float(rope["low_freq_factor"]),
                  rope_high_freq_factor=float(rope["high_freq_factor"]),
                  rope_original_max_len=int(rope["original_max_position_embeddings"]))
    kw.update({f: getattr(base, f) for f in RUNTIME_FIELDS})
    return ModelConfig(**kw)


def hf_config_from_model(cfg: ModelConfig, *, torch_dtype: str = "float32",
                         bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """A Llama `config.json` for a gendist model (dense SwiGLU models only)."""
    if cfg.moe_experts or cfg.mlp != "swiglu":
        raise UnsupportedCheckpoint(
            f"only dense SwiGLU models export to the Llama layout (model.mlp={cfg.mlp!r}, "
            f"model.moe_experts={cfg.moe_experts}).")
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "initializer_range": cfg.init_std,
        "rope_scaling": None, "torch_dtype": torch_dtype,
        "bos_token_id": bos_id, "eos_token_id": eos_id}
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len}
    return out


# --- the weight mapping ---------------------------------------------------------------

def _layer(name: str) -> str:
    return "model.layers.{i}." + name


def weight_map(cfg: ModelConfig) -> dict:
    """gendist path -> (HF name pattern, to_gendist(w), to_hf(w)) for one (layer's) tensor."""
    D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(heads):  # [heads·H, D] <-> [D, heads, H]
        return (lambda w: w.T.reshape(D, heads, H), lambda w: w.reshape(D, heads * H).T)

    ident = (lambda w: w, lambda w: w)
    trans = (lambda w: w.T, lambda w: w.T)
    m = {
        ("embed",): ("model.embed_tokens.weight", *ident),
        ("final_norm",): ("model.norm.weight", *ident),
        ("blocks", "attn_norm"): (_layer("input_layernorm.weight"), *ident),
        ("blocks", "wq"): (_layer("self_attn.q_proj.weight"), *proj(N)),
        ("blocks", "wk"): (_layer("self_attn.k_proj.weight"), *proj(K)),
        ("blocks", "wv"): (_layer("self_attn.v_proj.weight"), *proj(K)),
        ("blocks", "wo"): (_layer("self_attn.o_proj.weight"),
                           lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(N * H, D).T),
        ("blocks", "mlp_norm"): (_layer("post_attention_layernorm.weight"), *ident),
        ("blocks", "w_gate"): (_layer("mlp.gate_proj.weight"), *trans),
        ("blocks", "w_up"): (_layer("mlp.up_proj.weight"), *trans),
        ("blocks", "w_down"): (_layer("mlp.down_proj.weight"), *trans),
    }
    if not cfg.tie_embeddings:
        m[("head",)] = ("lm_head.weight", *trans)
    return m


class _Reader:
    """Tensors by name across the checkpoint's safetensors files (read lazily, as numpy)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open
        if (model_dir / INDEX).is_file():
            index = json.loads((model_dir / INDEX).read_text())["weight_map"]
        elif (model_dir / SINGLE).is_file():
            index = None
        else:
            raise FileNotFoundError(f"{str(model_dir)!r} holds neither {SINGLE} nor {INDEX}.")
        files = sorted(set(index.values())) if index else [SINGLE]
        self.handles = {f: safe_open(str(model_dir / f), framework="numpy") for f in files}
        self.where = index or {k: SINGLE for k in self.handles[SINGLE].keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return np.asarray(self.handles[self.where[name]].get_tensor(name), np.float32)


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_params(model_dir: str | Path, cfg: ModelConfig, shardings: dict | None = None) -> dict:
    """gendist params (fp32) from a HF directory: numpy arrays, or jax arrays placed on
    `shardings` (a dict of the params' structure) one parameter at a time."""
    reader = _Reader(Path(model_dir))
    shapes = transformer.param_shapes(cfg)
    out: dict = {}
    for path, (pattern, to_ours, _) in weight_map(cfg).items():
        want = tuple(_get(shapes, path).shape)
        if path[0] == "blocks":
            host = np.stack([to_ours(reader.get(pattern.format(i=i)))
                             for i in range(cfg.num_layers)])
        else:
            host = to_ours(reader.get(pattern))
        if host.shape != want:
            raise ValueError(f"{pattern}: shape {host.shape} in gendist's layout, but "
                             f"config.json implies {want}; the checkpoint and its config "
                             "disagree.")
        if shardings is None:
            _set(out, path, host)
        else:
            sh = _get(shardings, path)
            _set(out, path, jax.make_array_from_callback(want, sh, lambda idx, h=host: h[idx]))
    if cfg.tie_embeddings and "lm_head.weight" in reader:
        lm = reader.get("lm_head.weight")
        if not np.array_equal(lm, reader.get("model.embed_tokens.weight")):
            raise UnsupportedCheckpoint("config.json says tie_word_embeddings=true but "
                                        "lm_head.weight differs from the embedding.")
    return out


def load(model_dir: str | Path, base: ModelConfig | None = None,
         shardings: dict | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a HF Llama directory (see `load_params`)."""
    cfg = model_config_from_hf(read_config(model_dir), base)
    return cfg, load_params(model_dir, cfg, shardings)


def check_target(model_dir: str | Path, overwrite: bool = False, flag: str = "") -> None:
    """Refuse to write a model directory over a file, or over a folder holding files unless
    `overwrite` (`flag`: the option naming the folder, e.g. --out, for the message)."""
    out = Path(model_dir)
    name = f"{flag} {str(model_dir)!r}" if flag else repr(str(model_dir))
    if out.exists() and not out.is_dir():
        raise ValueError(f"{name} is a file; give a folder for the model (a new one).")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f", ... ({len(held)} entries)" if len(held) > 4 else "")
        fix = ("pass --overwrite to replace the folder whole, or give a new --out" if flag
               else "pass overwrite=True to replace it whole, or write to a new directory")
        raise ValueError(f"{name} already holds {shown}; {fix}.")


def save(model_dir: str | Path, cfg: ModelConfig, params: dict, *, dtype: str = "float32",
         max_shard_bytes: int = 5 << 30, tokenizer=None, overwrite: bool = False) -> list[str]:
    """Write params as a HF Llama directory (config.json, safetensors shards + index when
    more than one, and the tokenizer's files if given: gendist's byte-level tokenizer as
    gendist_tokenizer.json). Returns the safetensors file names.

    `dtype`: float32 (bitwise round trip) or bfloat16 (half the bytes). The directory is
    written whole into a temporary folder beside it and then moved into place: a folder
    holding files is refused (`check_target`) unless `overwrite`, which replaces it whole,
    never leaving a mix of its old files and the new ones.
    """
    from safetensors.numpy import save_file

    from gendist.data.tokenizer import write_bytes_marker
    check_target(model_dir, overwrite)
    np_dtype = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}[dtype]
    out = Path(model_dir)
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    hf = hf_config_from_model(cfg, torch_dtype=dtype, bos_id=bos, eos_id=eos)
    params = jax.device_get(params)
    tensors: dict[str, np.ndarray] = {}
    for path, (pattern, _, to_hf) in weight_map(cfg).items():
        w = np.asarray(_get(params, path), np.float32)
        if path[0] == "blocks":
            for i in range(cfg.num_layers):
                tensors[pattern.format(i=i)] = np.ascontiguousarray(to_hf(w[i]).astype(np_dtype))
        else:
            tensors[pattern] = np.ascontiguousarray(to_hf(w).astype(np_dtype))
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with staging.staged(out, "export") as stage:
        for name, shard in zip(names, shards, strict=True):
            save_file(shard, str(stage / name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                     "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in s}}
            (stage / INDEX).write_text(json.dumps(index, indent=2))
        (stage / CONFIG).write_text(json.dumps(hf, indent=2))
        for f in getattr(tokenizer, "files", ()):
            shutil.copyfile(f, stage / Path(f).name)
        if getattr(tokenizer, "name", None) == "bytes":
            write_bytes_marker(stage)
        _replace_dir(stage, out)
    return names


def _replace_dir(new: Path, out: Path) -> None:
    """Put folder `new` at `out` (two renames on one file system; the old folder, if any,
    is deleted only once the new one is in place)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        new.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old)


def param_shardings(mesh, cfg: ModelConfig, zero_stage: int = 0) -> dict:
    """Where each parameter lives on `mesh` by the logical-axis table (ZeRO from stage 1)."""
    shapes = transformer.param_shapes(cfg)
    return zero.param_shardings(mesh, transformer.logical_axes(cfg), shapes, zero_stage)


def with_runtime(cfg: ModelConfig, **kw) -> ModelConfig:
    """The loaded architecture with other runtime fields (e.g. dtype='bfloat16')."""
    bad = set(kw) - set(RUNTIME_FIELDS) - {"max_seq_len"}
    if bad:
        raise ValueError(f"{sorted(bad)} describe the checkpoint's architecture; only "
                         f"{RUNTIME_FIELDS + ('max_seq_len',)} can differ from config.json.")
    return dataclasses.replace(cfg, **kw)

