"""Command-line pieces for real data and real models, used by `gendist.__main__`.

    python -m gendist prepare --out DIR --data.corpus 'books/*.txt' --data.tokenizer tok.json
    python -m gendist train --init-from MODEL_DIR --data.tokens DIR [--config run.yaml]
    python -m gendist generate --model-dir MODEL_DIR [--draft-dir DRAFT_DIR] --prompt TEXT
    python -m gendist export --checkpoint runs/x --out MODEL_DIR [--dtype bfloat16]

`--config FILE` (any command that takes a config) starts from a saved `config.yaml`
instead of a preset; flags after it override its fields.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gendist.config import Config, DataConfig, GenerateConfig


class UsageError(ValueError):
    """A command line that cannot run (a missing or malformed option)."""


def pop_option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """Remove `name VALUE` or `name=VALUE` from argv and return VALUE."""
    for i, a in enumerate(argv):
        if a == name:
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i: i + 2]
            return value
        if a.startswith(name + "="):
            del argv[i]
            return a.split("=", 1)[1]
    return default


def base_config(argv: list[str], default_preset: str = "tiny") -> tuple[Config, str]:
    """(the config flags override, its description): `--config FILE` or `--preset NAME`."""
    from gendist import config_yaml
    from gendist.presets import preset
    path = pop_option(argv, "--config")
    name = pop_option(argv, "--preset")
    if path is not None:
        if name is not None:
            raise ValueError("give --config FILE or --preset NAME, not both: a config file "
                             "is a whole config (start it from a preset's saved config.yaml).")
        return config_yaml.load(path), f"config file {path!r}"
    name = name or default_preset
    return preset(name), f"preset {name!r}"


# --- prepare ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrepareArgs:
    """Tokenize a corpus into token-file shards plus a validation split (see tokenfiles)."""

    out: str  # folder for train_*.bin, val_*.bin, meta.json and a copy of the tokenizer
    data: DataConfig = field(default_factory=DataConfig)  # corpus, tokenizer, text field, split
    shard_tokens: int = 1 << 28  # tokens per shard file (uint16: 512 MiB)
    progress: bool = True  # show a progress bar


def cmd_prepare(argv: list[str]) -> int:
    import tyro

    from gendist.data.tokenfiles import prepare
    a = tyro.cli(PrepareArgs, args=argv, description=PrepareArgs.__doc__)
    d = a.data
    meta = prepare(tuple(d.corpus), d.tokenizer, a.out, text_field=d.text_field,
                   val_fraction=d.val_fraction, shard_tokens=a.shard_tokens,
                   progress=a.progress)
    n = meta["num_tokens"]
    print(f"wrote {n['train']} train + {n['val']} validation tokens ({meta['dtype']}, "
          f"vocabulary {meta['vocab_size']}, {len(meta['train'])} + {len(meta['val'])} shards) "
          f"to {a.out}; train on them with --data.tokens {a.out}")
    return 0


# --- train --init-from ------------------------------------------------------------------

def resolve_train(cfg: Config, init_from: str | None = None):
    """(config, init_params or None, tokenizer) for a training run.

    `init_from`: a Hugging Face model directory (config.json + safetensors) or a gendist
    run directory; the architecture comes from it (runtime fields such as dtype from the
    flags), and so does the tokenizer when data.tokenizer is left at bytes. Then
    model.vocab_size follows the tokenizer: raised to its vocabulary when smaller (a larger
    value is kept, e.g. padded to a multiple of mesh.tensor); a loaded model's vocabulary
    is fixed, so a larger tokenizer is refused.
    """
    from gendist import hf
    from gendist.data.tokenfiles import META
    from gendist.data.tokenizer import find_tokenizer_file, load_tokenizer
    init = None
    m, d = cfg.model, cfg.data
    if d.tokens and (Path(d.tokens) / META).is_file():
        from gendist.data.tokenfiles import open_token_dir, tokenizer_of
        d = dataclasses.replace(d, tokenizer=tokenizer_of(d.tokens, open_token_dir(d.tokens)[2]))
    if init_from is not None:
        src = Path(init_from)
        if (src / hf.CONFIG).is_file():
            m = hf.model_config_from_hf(hf.read_config(src), m)
            init = lambda shardings: hf.load_params(src, m, shardings)  # noqa: E731
        else:
            import jax

            from gendist.training.serialize import load_params
            loaded_cfg, params, _ = load_params(src)
            m = dataclasses.replace(loaded_cfg, **{f: getattr(m, f) for f in hf.RUNTIME_FIELDS})
            init = jax.device_get(params)  # host arrays: placed per shard by loop.run
        if d.tokenizer == "bytes" and not d.tokens and find_tokenizer_file(src):
            d = dataclasses.replace(d, tokenizer=str(src))
    tok = load_tokenizer(d.tokenizer)
    # Bytes: the model's vocabulary is the user's (text that uses only ASCII trains with 128;
    # the data check refuses ids it cannot embed). A tokenizer's vocabulary is followed.
    if m.vocab_size < tok.vocab_size and tok.name != "bytes":
        if init is not None:
            raise ValueError(
                f"data.tokenizer={d.tokenizer!r} has {tok.vocab_size} tokens but the model "
                f"from {init_from} embeds only {m.vocab_size}; use the model's own tokenizer.")
        m = dataclasses.replace(m, vocab_size=tok.vocab_size)
    return dataclasses.replace(cfg, model=m, data=d), init, tok


def loss_unit(tok) -> str:
    return "nats/byte (uniform: 5.545)" if tok.name == "bytes" else "nats/token"


# --- generate -----------------------------------------------------------------------------

def sample(model_cfg, params, tok, g: GenerateConfig, prompts: list[str]) -> list[str]:
    """Continuations of `prompts` with a tokenizer (stops at g.eos_id, else the tokenizer's),
    decoded on `g.path` (`decoder.plan`); the path line and the decode speed go to stderr."""
    import time

    import jax
    import jax.numpy as jnp

    from gendist.inference import decoder
    from gendist.inference.generate import check_lengths, generate, pad_prompts
    from gendist.inference.sampling import SamplingParams
    eos = g.eos_id if g.eos_id >= 0 or tok.eos_id is None else tok.eos_id
    prompt_BT, len_B = pad_prompts([tok.encode_prompt(p) for p in prompts])
    B, T = prompt_BT.shape
    check_lengths(model_cfg, T, g.max_new_tokens)
    plan = decoder.plan(model_cfg, params, B, T + g.max_new_tokens, g.path)
    print(plan.line, file=sys.stderr, flush=True)
    args = (plan, jnp.asarray(prompt_BT), jnp.asarray(len_B), jax.random.key(g.seed))
    t0 = time.perf_counter()
    run = generate.lower(*args, max_new_tokens=g.max_new_tokens, eos_id=eos,
                         sp=SamplingParams(g.temperature, g.top_k, g.top_p)).compile()
    t1 = time.perf_counter()
    out, count = jax.device_get(run(*args))
    t2 = time.perf_counter()
    n = int(count.sum())
    print(f"decode: {n} tokens in {t2 - t1:.3f} s, {n / (t2 - t1):.1f} tokens/s (prompt "
          f"included; compiled in {t1 - t0:.1f} s)", file=sys.stderr, flush=True)
    return [tok.decode([t for t in o[:c] if t != eos]) for o, c in zip(out, count, strict=True)]


def speculative_sample(tcfg, tparams, dcfg, dparams, tok, g: GenerateConfig, prompt: str,
                       gamma: int):
    """(continuation, statistics) with `dcfg` drafting for `tcfg` (same vocabulary). Each
    model decodes through its own plan (`decoder.plan`, lines on stderr) on `g.path`; an
    explicit "megakernel" is the draft's (one token a call), the target then takes "auto"
    (it verifies gamma + 1 tokens a call)."""
    import jax
    import jax.numpy as jnp

    from gendist.inference import decoder
    from gendist.inference.generate import check_lengths, pad_prompts
    from gendist.inference.lm import transformer_lm
    from gendist.inference.sampling import SamplingParams
    from gendist.inference.speculative import SpecConfig, speculative_generate
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"--draft-dir: the draft's vocabulary ({dcfg.vocab_size}) differs from "
                         f"the target's ({tcfg.vocab_size}); pair models sharing a tokenizer.")
    eos = g.eos_id if g.eos_id >= 0 or tok.eos_id is None else tok.eos_id
    prompt_BT, len_B = pad_prompts([tok.encode_prompt(prompt)])
    check_lengths(tcfg, prompt_BT.shape[1], g.max_new_tokens + gamma + 1)
    max_len = prompt_BT.shape[1] + g.max_new_tokens + gamma + 1
    target = decoder.plan(tcfg, tparams, 1, max_len, "auto" if g.path == "megakernel" else g.path,
                          step_tokens=gamma + 1)
    draft = decoder.plan(dcfg, dparams, 1, max_len, g.path)
    print(f"{target.line} [target]\n{draft.line} [draft]", file=sys.stderr, flush=True)
    out, count, stats = speculative_generate(
        transformer_lm(target, "target"), target.params, transformer_lm(draft, "draft"),
        draft.params, jnp.asarray(prompt_BT),
        jnp.asarray(len_B), jax.random.key(g.seed), max_new_tokens=g.max_new_tokens,
        sp=SamplingParams(g.temperature, g.top_k, g.top_p), spec=SpecConfig(gamma=gamma),
        eos_id=eos)
    out, count, stats = jax.device_get((out, count, stats))
    return tok.decode([t for t in out[0][: count[0]] if t != eos]), stats


def cmd_generate_model_dir(argv: list[str], model_dir: str) -> int:
    """generate --model-dir DIR [--draft-dir DIR] [--gamma G] [--dtype D] --prompt TEXT."""
    import tyro

    from gendist import hf
    from gendist.config import ModelConfig
    from gendist.data.tokenizer import find_tokenizer_file, load_tokenizer
    prompt = pop_option(argv, "--prompt")
    draft_dir = pop_option(argv, "--draft-dir")
    gamma = int(pop_option(argv, "--gamma", "4"))
    dtype = pop_option(argv, "--dtype", "float32")
    tok_spec = pop_option(argv, "--tokenizer")
    g = tyro.cli(GenerateConfig, args=argv, description="sampling options")
    if prompt is not None:
        g = dataclasses.replace(g, prompt=prompt)
    base = ModelConfig(dtype=dtype)
    cfg, params = hf.load(model_dir, base)
    if tok_spec is None and find_tokenizer_file(Path(model_dir)) is None:
        raise FileNotFoundError(f"--model-dir {model_dir!r} has no tokenizer.json or "
                                "tokenizer.model; pass --tokenizer FILE.")
    tok = load_tokenizer(tok_spec or model_dir)
    print(f"{model_dir}: {cfg.num_params / 1e6:.2f}M params, vocabulary {cfg.vocab_size}",
          file=sys.stderr)
    if draft_dir is None:
        print(g.prompt + sample(cfg, params, tok, g, [g.prompt])[0])
        return 0
    dcfg, dparams = hf.load(draft_dir, base)
    text, stats = speculative_sample(cfg, params, dcfg, dparams, tok, g, g.prompt, gamma)
    print(g.prompt + text)
    print(f"speculative: {int(stats['accepted'])} of {int(stats['proposed'])} draft tokens "
          f"accepted in {int(stats['steps'])} target calls", file=sys.stderr)
    return 0


def run_tokenizer(run_dir: str):
    """The tokenizer a run trained with (its saved config.yaml), or bytes."""
    from gendist import config_yaml
    from gendist.data.tokenizer import load_tokenizer
    saved = Path(run_dir) / config_yaml.YAML_NAME
    return load_tokenizer(config_yaml.load(saved).data.tokenizer if saved.is_file() else "bytes")


# --- export ------------------------------------------------------------------------------

def cmd_export(argv: list[str]) -> int:
    """export --checkpoint RUN_DIR --out MODEL_DIR [--dtype float32|bfloat16] [--tokenizer T]."""
    from gendist import hf
    from gendist.data.tokenizer import load_tokenizer
    from gendist.training.serialize import load_params
    ckpt, out = pop_option(argv, "--checkpoint"), pop_option(argv, "--out")
    dtype = pop_option(argv, "--dtype", "float32")
    tok_spec = pop_option(argv, "--tokenizer")
    if ckpt is None or out is None or argv:
        print("usage: python -m gendist export --checkpoint RUN_DIR --out MODEL_DIR "
              "[--dtype float32|bfloat16] [--tokenizer SPEC]", file=sys.stderr)
        return 2
    model_cfg, params, step = load_params(ckpt)
    tok = run_tokenizer(ckpt) if tok_spec is None else load_tokenizer(tok_spec)
    names = hf.save(out, model_cfg, params, dtype=dtype, tokenizer=tok)
    print(f"exported step {step} ({model_cfg.num_params / 1e6:.2f}M params) to {out}: "
          f"{', '.join(names)}")
    return 0
