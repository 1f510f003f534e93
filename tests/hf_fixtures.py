"""Tiny random Llama checkpoints in the Hugging Face layout, and an independent NumPy forward.

`write_llama` writes config.json + safetensors with the `safetensors` library directly (not
through gendist), with HF's tensor names and [out, in] Linear layout. `hf_llama_logits` is
the Hugging Face `LlamaForCausalLM` forward transcribed into NumPy float64 from
transformers' modeling_llama.py / modeling_rope_utils.py: RMSNorm, `rotate_half` RoPE with
cos/sin = cat(freqs, freqs), Llama-3 frequency scaling, `repeat_kv` for GQA, causal softmax
attention, SwiGLU MLP, tied or untied head. It shares no code with gendist.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def llama_config(*, vocab=96, hidden=48, layers=2, heads=8, kv_heads=4, head_dim=8,
                 ffn=64, tied=True, theta=500_000.0, rope_scaling=None, eps=1e-5) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "max_position_embeddings": 2048, "rope_theta": theta,
            "rms_norm_eps": eps, "tie_word_embeddings": tied, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "rope_scaling": rope_scaling,
            "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def random_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named fp32 tensors; scales chosen so logits are O(1)."""
    rng = np.random.default_rng(seed)
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def mat(o, i):
        return (rng.standard_normal((o, i)) / math.sqrt(i)).astype(np.float32)

    def norm():
        return (1.0 + 0.2 * rng.standard_normal(D)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
         "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": mat(N * H, D),
                  p + "self_attn.k_proj.weight": mat(K * H, D),
                  p + "self_attn.v_proj.weight": mat(K * H, D),
                  p + "self_attn.o_proj.weight": mat(D, N * H),
                  p + "post_attention_layernorm.weight": norm(),
                  p + "mlp.gate_proj.weight": mat(F, D),
                  p + "mlp.up_proj.weight": mat(F, D),
                  p + "mlp.down_proj.weight": mat(D, F)})
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(V, D)
    return w


def write_llama(model_dir: Path, cfg: dict, weights: dict, shards: int = 1) -> None:
    """config.json and `shards` safetensors files (with an index when more than one)."""
    from safetensors.numpy import save_file
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    names = list(weights)
    if shards == 1:
        save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    groups = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for s, idx in enumerate(groups):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[i]: weights[names[i]] for i in idx}, str(model_dir / fname),
                  metadata={"format": "pt"})
        weight_map.update({names[i]: fname for i in idx})
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


# --- the Hugging Face Llama forward, in NumPy float64 ------------------------------------

def hf_inv_freq(cfg: dict) -> np.ndarray:
    """modeling_rope_utils: default inv_freq, then _compute_llama3_parameters if asked."""
    H, base = cfg["head_dim"], cfg["rope_theta"]
    inv_freq = 1.0 / (base ** (np.arange(0, H, 2, dtype=np.int64).astype(np.float64) / H))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv_freq
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


def _rms_norm(x, w, eps):
    var = np.mean(x * x, axis=-1, keepdims=True)
    return w * (x / np.sqrt(var + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def hf_llama_logits(cfg: dict, w: dict, ids_BT: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM(input_ids).logits, float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    B, T = ids_BT.shape
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][ids_BT]  # [B, T, D]
    freqs = np.arange(T)[:, None] * hf_inv_freq(cfg)[None, :]  # [T, H/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # [1, 1, T, H]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, K, H).transpose(0, 2, 1, 3)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, K, H).transpose(0, 2, 1, 3)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # repeat_kv
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(H) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v  # [B, N, T, H]
        a = a.transpose(0, 2, 1, 3).reshape(B, T, N * H)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
