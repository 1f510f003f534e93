"""LoRA (Hu et al. 2021, arXiv:2106.09685): low-rank adapters on frozen base weights.

A projection W [in, out] (with its leading `layers` axis) is used as

    W_eff = W + (alpha / r) · A · B,    A [in, r] random (Gaussian, as in the paper), B [r, out] 0

so the model starts exactly at the base. Only A and B train: the train state holds them as
its `params` (so the optimizer, ZeRO placement, clipping and accumulation see adapters
only) and the frozen base beside them (`state["base"]`, optionally bf16: no gradient, no
optimizer state). The loss merges on the fly (`merged`) and hands every gradient engine
(plain, manual, pipeline, TeraPipe) ordinary params; the adapters' gradients are the merge's
vector-Jacobian product of the engine's: dA = s·G·Bᵀ, dB = s·Aᵀ·G for G = ∂L/∂W_eff.

Adapters carry logical axes (A: the adapted weight's input axes then an unsharded rank,
B: an unsharded rank then its output axes), so the one table in `gendist.sharding` places
them where the layer they adapt lives. A saved adapter folder (`save`) holds adapters.npz
and adapter_config.json (rank, alpha, targets, the model's shape).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gendist.config import Config, ModelConfig, TrainConfig
from gendist.models import params as P

# train.lora_targets name -> (parameter in `blocks`, how many of its axes after `layers` are
# inputs). wo [N, H, D] takes the heads as its input; the rest take one axis.
PROJECTIONS = {"q": ("wq", 1), "k": ("wk", 1), "v": ("wv", 1), "o": ("wo", 2),
               "gate": ("w_gate", 1), "up": ("w_up", 1), "down": ("w_down", 1)}
CONFIG_FILE, ARRAYS_FILE = "adapter_config.json", "adapters.npz"
BASE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def enabled(cfg: Config | TrainConfig) -> bool:
    t = cfg.train if isinstance(cfg, Config) else cfg
    return t.lora_rank > 0


def targets(t: TrainConfig) -> tuple[str, ...]:
    """The adapted parameters' names in `blocks`, in table order."""
    names = {PROJECTIONS[x][0] for x in t.lora_targets.split(",")}
    return tuple(w for w, _ in PROJECTIONS.values() if w in names)


def scale(t: TrainConfig) -> float:
    return t.lora_alpha / t.lora_rank


def _n_in(name: str) -> int:
    return next(n for w, n in PROJECTIONS.values() if w == name)


def specs(model: ModelConfig, t: TrainConfig) -> dict:
    """{"blocks": {name: {"a": ParamSpec, "b": ParamSpec}}}: shapes, logical axes, init."""
    base = P.param_specs(model)["blocks"]
    r, out = t.lora_rank, {}
    for name in targets(t):
        if name not in base:
            continue  # e.g. w_gate of a GELU model
        s, k = base[name], _n_in(name)
        ins, outs = s.shape[1:1 + k], s.shape[1 + k:]
        out[name] = {
            "a": P.ParamSpec((s.shape[0], *ins, r), (s.axes[0], *s.axes[1:1 + k], None),
                             "fan_in", math.prod(ins)),
            "b": P.ParamSpec((s.shape[0], r, *outs), (s.axes[0], None, *s.axes[1 + k:]), "zeros"),
        }
    return {"blocks": out}


def _is_spec(x) -> bool:
    return isinstance(x, P.ParamSpec)


def logical_axes(model: ModelConfig, t: TrainConfig) -> dict:
    return jax.tree.map(lambda s: s.axes, specs(model, t), is_leaf=_is_spec)


def shapes(model: ModelConfig, t: TrainConfig) -> dict:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs(model, t),
                        is_leaf=_is_spec)


def init(model: ModelConfig, t: TrainConfig, seed: int) -> dict:
    """A ~ N(0, 1/fan_in) (the paper's random Gaussian A), B = 0: W_eff = W at step 0."""
    leaves, treedef = jax.tree.flatten(specs(model, t), is_leaf=_is_spec)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0x10EA), len(leaves))

    def one(key, s):
        if s.init == "zeros":
            return jnp.zeros(s.shape, jnp.float32)
        return jax.random.normal(key, s.shape, jnp.float32) * s.fan_in ** -0.5
    return jax.tree.unflatten(treedef, [one(k, s) for k, s in zip(keys, leaves, strict=True)])


def base_params(params: dict, t: TrainConfig) -> dict:
    """The frozen base as stored: matrices in train.lora_base_dtype, vectors in fp32."""
    dt = BASE_DTYPES[t.lora_base_dtype]
    return jax.tree.map(lambda w: w.astype(dt) if w.ndim >= 2 else w, params)


def delta(name: str, a, b, s: float):
    """(alpha/r) · A · B as a [layers, *in, *out] array in fp32 (contracting the rank)."""
    k = _n_in(name)
    letters = iter(string.ascii_lowercase[1:])
    ins = "".join(next(letters) for _ in range(k))
    outs = "".join(next(letters) for _ in range(b.ndim - 2))
    eq = f"l{ins}z,lz{outs}->l{ins}{outs}"
    return s * jnp.einsum(eq, a.astype(jnp.float32), b.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)


def merged(base: dict, adapters: dict, s: float, dtype=None) -> dict:
    """Base params with W + (alpha/r)·A·B on every adapted projection. Merged matrices are
    fp32 (a bf16 base: `dtype`, the compute dtype, if given); the others pass through."""
    blocks = dict(base["blocks"])
    for name, ab in adapters["blocks"].items():
        w = base["blocks"][name]
        out_dt = dtype if (dtype is not None and w.dtype != jnp.float32) else jnp.float32
        blocks[name] = (w.astype(jnp.float32) + delta(name, ab["a"], ab["b"], s)).astype(out_dt)
    return {**base, "blocks": blocks}


def wrap_engine(cfg: Config, engine: Callable, place: Callable = lambda p: p) -> Callable:
    """An engine over {"adapters", "base"}: the inner engine runs on the merged params
    (`place` lays them out like the base), and its gradients of the adapted weights are
    pulled back onto A and B (the merge's VJP); the base gets none."""
    s = scale(cfg.train)
    dtype = P.DTYPES[cfg.model.dtype]

    def engine_fn(inputs, batch):
        base, adapters = inputs["base"], inputs["adapters"]
        eff, pullback = jax.vjp(lambda ad: place(merged(base, ad, s, dtype)), adapters)
        loss, metrics, g = engine(eff, batch)
        ct = jax.tree.map(lambda x, e: jnp.zeros_like(e) if x is None else x.astype(e.dtype),
                          _only_adapted(g, adapters), eff, is_leaf=lambda x: x is None)
        (g_ad,) = pullback(ct)
        return loss, metrics, g_ad

    return engine_fn


def _only_adapted(g: dict, adapters: dict) -> dict:
    """The engine's gradients with the non-adapted leaves as None (zeros in the VJP)."""
    names = set(adapters["blocks"])
    out = jax.tree.map(lambda _: None, g)
    out["blocks"] = {k: (v if k in names else None) for k, v in g["blocks"].items()}
    return out


# --- saved adapters ---------------------------------------------------------------------------


def save(directory: str | Path, model: ModelConfig, t: TrainConfig, adapters: dict) -> Path:
    """adapters.npz (A and B of each adapted projection, fp32) and adapter_config.json."""
    import dataclasses
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    arrays = {f"{name}.{ab}": np.asarray(jax.device_get(v))
              for name, pair in adapters["blocks"].items() for ab, v in pair.items()}
    tmp = d / (ARRAYS_FILE + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(d / ARRAYS_FILE)
    meta = {"rank": t.lora_rank, "alpha": t.lora_alpha, "targets": t.lora_targets,
            "model": dataclasses.asdict(model)}
    (d / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    return d


def load(directory: str | Path, flag: str = "--adapters") -> tuple[TrainConfig, dict, dict]:
    """(a TrainConfig with the adapters' rank/alpha/targets, the adapters, the saved model
    fields) from a folder `save` wrote; a missing or unreadable one is one line naming `flag`."""
    d = Path(directory)
    if not (d / CONFIG_FILE).is_file() or not (d / ARRAYS_FILE).is_file():
        raise FileNotFoundError(f"{flag} {str(directory)!r} holds no {CONFIG_FILE} and "
                                f"{ARRAYS_FILE}; give the adapters folder a LoRA run wrote "
                                "(its train.out_dir/adapters).")
    try:
        meta = json.loads((d / CONFIG_FILE).read_text())
        with np.load(d / ARRAYS_FILE) as z:
            arrays = {k: z[k] for k in z.files}
        t = TrainConfig(lora_rank=int(meta["rank"]), lora_alpha=float(meta["alpha"]),
                        lora_targets=str(meta["targets"]))
    except Exception as e:  # noqa: BLE001 - JSON, zip, key and value errors alike
        raise ValueError(f"{flag} {str(directory)!r}: the adapters cannot be read "
                         f"({type(e).__name__}: {str(e)[:100]}); save them again.") from e
    blocks: dict = {}
    for key, v in arrays.items():
        name, ab = key.rsplit(".", 1)
        blocks.setdefault(name, {})[ab] = v
    return t, {"blocks": blocks}, meta.get("model", {})


def check_fits(adapters: dict, model: ModelConfig, t: TrainConfig, flag: str) -> None:
    """The adapters' shapes must be the ones this model's projections take."""
    want = jax.tree.map(lambda s: s.shape, specs(model, t), is_leaf=_is_spec)
    got = jax.tree.map(lambda a: tuple(a.shape), adapters)
    if want != got:
        raise ValueError(f"{flag}: the adapters' shapes {got['blocks']} do not fit this model "
                         f"(it needs {want['blocks']}); give adapters trained on this base.")


def merge_into(params: dict, adapters: dict, t: TrainConfig) -> dict:
    """Host-side merge for export/generate: fp32 base params with the adapters folded in."""
    base = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), params)
    return jax.device_get(merged(base, jax.tree.map(jnp.asarray, adapters), scale(t)))
