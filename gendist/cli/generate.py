"""`generate`: sample from a run's checkpoint, a Hugging Face Llama directory (optionally
with a draft model for speculative decoding) or a preset's random weights, through the
decode front door (`gendist.inference.decoder`: the path line and tokens/s on stderr)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Literal

from gendist.cli.args import UsageError, parse
from gendist.config import GenerateConfig


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample from a run (--checkpoint DIR), a Hugging Face Llama directory (--model-dir DIR,
    with --draft-dir DIR for speculative decoding) or a preset's random weights (--preset
    NAME: a decode benchmark). `--prompt TEXT` is short for `--generate.prompt TEXT`, and so
    for every --generate.* field."""

    checkpoint: str = ""  # a run's train.out_dir (e.g. runs/default) or its checkpoints/ folder
    model_dir: str = ""  # a Hugging Face Llama directory (config.json + safetensors)
    draft_dir: str = ""  # with --model-dir: a smaller Llama directory drafting for it (same tokenizer)
    gamma: int = 4  # with --draft-dir: draft tokens proposed per target call
    dtype: Literal["float32", "bfloat16"] = "float32"  # with --model-dir: compute dtype
    tokenizer: str = ""  # with --model-dir: a tokenizer file or "bytes" (default: the directory's)
    preset: str = ""  # a preset's shape with random weights (no trained model needed)
    adapters: str = ""  # LoRA adapters (a LoRA run's adapters/ folder) merged into the model
    generate: GenerateConfig = dataclasses.field(default_factory=GenerateConfig)


def _shorthand(argv: list[str]) -> list[str]:
    """`--top-k 5` (any GenerateConfig field) read as `--generate.top-k 5`."""
    fields = {f.name.replace("_", "-") for f in dataclasses.fields(GenerateConfig)}
    return [f"--generate.{a[2:]}" if a.startswith("--") and a[2:].split("=")[0] in fields
            else a for a in argv]


def cmd_generate(argv: list[str]) -> int:
    args = parse(GenerateArgs, _shorthand(argv), "generate", description=GenerateArgs.__doc__)
    sources = [f"--{n.replace('_', '-')}" for n in ("checkpoint", "model_dir", "preset")
               if getattr(args, n)]
    if not sources:
        raise UsageError("generate needs --checkpoint DIR (a run's train.out_dir, e.g. "
                         "runs/default, or its checkpoints/ folder), --model-dir DIR (a Hugging "
                         "Face Llama directory) or --preset NAME (random weights)")
    if len(sources) > 1:
        raise UsageError(f"generate takes one of {' / '.join(sources)}: each names the model")
    if args.gamma < 1:
        raise UsageError(f"--gamma {args.gamma}: give at least 1 draft token per target call")
    if args.model_dir:
        return _generate_model_dir(args)
    g = args.generate

    import jax
    if args.preset:
        from gendist.data.tokenizer import load_tokenizer
        from gendist.models.params import init_params
        from gendist.presets import preset
        cfg = preset(args.preset)
        model_cfg, tok = cfg.model, load_tokenizer(cfg.data.tokenizer)
        params = init_params(model_cfg, g.seed)
        print(f"weights: random (preset {args.preset}; {model_cfg.params_text()}); give "
              "--checkpoint DIR for a trained model", flush=True)
    else:
        from gendist.training.serialize import find_checkpoint_dir, load_params
        find_checkpoint_dir(args.checkpoint)  # a missing folder named before anything else
        tok = run_tokenizer(args.checkpoint)
        model_cfg, params, step = load_params(args.checkpoint)
        check_tokenizer_fits(model_cfg, tok, f"the run's tokenizer ({tok.name})",
                             f"--checkpoint {args.checkpoint}")
        print(f"checkpoint {Path(args.checkpoint)} step {step}; {model_cfg.params_text()}",
              flush=True)
        params = jax.device_get(params)
    if args.adapters:
        params = with_adapters(model_cfg, params, args.adapters)
    print(g.prompt + sample(model_cfg, params, tok, g, [g.prompt])[0])
    return 0


def check_tokenizer_fits(model_cfg, tok, tokenizer: str, model: str) -> None:
    """Refuse a tokenizer with more tokens than the model embeds (`tokenizer`, `model`: how
    the user named them). Bytes are exempt (a model may embed only the bytes its text
    used); `check_prompt` checks the ids a prompt gives."""
    if tok.name != "bytes" and tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"{tokenizer} has {tok.vocab_size} tokens but the model of {model} embeds only "
            f"{model_cfg.vocab_size} (its vocab_size): they were not trained together; give "
            "the tokenizer the model was trained with.")


def check_prompt(model_cfg, tok, g: GenerateConfig, prompts: list[str]) -> list:
    """The prompts' token ids, refused before any decoding when a prompt is empty, holds an
    id the model has no embedding for, or leaves no room for g.max_new_tokens."""
    ids = [tok.encode_prompt(p) for p in prompts]
    for p, t in zip(prompts, ids, strict=True):
        if len(t) == 0:
            raise ValueError("--generate.prompt is empty; give at least one character, e.g. "
                             "--generate.prompt 'ROMEO:'.")
        if int(max(t)) >= model_cfg.vocab_size:
            raise ValueError(
                f"--generate.prompt {p[:40]!r} holds token id {int(max(t))} but the model "
                f"embeds only {model_cfg.vocab_size} (model.vocab_size); give a prompt of "
                f"the characters it was trained on (ids below {model_cfg.vocab_size}).")
        room = model_cfg.max_seq_len - len(t)
        if g.max_new_tokens > room:
            raise ValueError(
                f"--generate.max-new-tokens {g.max_new_tokens} after the {len(t)}-token "
                f"prompt exceeds model.max_seq_len={model_cfg.max_seq_len}; pass "
                f"--generate.max-new-tokens {max(room, 0)} or less, or a shorter prompt.")
    return ids


def _generate_model_dir(args: GenerateArgs) -> int:
    from gendist import hf
    from gendist.config import ModelConfig
    from gendist.data.tokenizer import find_tokenizer_file, load_tokenizer
    g, model_dir = args.generate, args.model_dir
    base = ModelConfig(dtype=args.dtype)
    cfg = _model_dir_config(model_dir, "--model-dir", base)
    dcfg = _model_dir_config(args.draft_dir, "--draft-dir", base) if args.draft_dir else None
    if dcfg is not None and dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"--draft-dir: the draft's vocabulary ({dcfg.vocab_size}) differs from "
                         f"the target's ({cfg.vocab_size}); pair models sharing a tokenizer.")
    if not args.tokenizer and find_tokenizer_file(Path(model_dir)) is None:
        fix = ("--tokenizer bytes (a byte-level model) or --tokenizer FILE"
               if cfg.vocab_size <= 256 else "--tokenizer FILE (the model's tokenizer.json "
               "or tokenizer.model)")
        raise FileNotFoundError(f"--model-dir {model_dir!r} has no tokenizer.json, "
                                f"tokenizer.model or gendist_tokenizer.json; pass {fix}.")
    tok = load_tokenizer(args.tokenizer or model_dir)
    check_tokenizer_fits(cfg, tok, f"--tokenizer {args.tokenizer}" if args.tokenizer else
                         f"the tokenizer of --model-dir ({tok.name})", f"--model-dir {model_dir}")
    check_prompt(cfg, tok, g, [g.prompt])
    params = hf.load_params(model_dir, cfg)
    if args.adapters:
        params = with_adapters(cfg, params, args.adapters)
    print(f"{model_dir}: {cfg.num_params / 1e6:.2f}M params, vocabulary {cfg.vocab_size}",
          file=sys.stderr)
    if dcfg is None:
        print(g.prompt + sample(cfg, params, tok, g, [g.prompt])[0])
        return 0
    dparams = hf.load_params(args.draft_dir, dcfg)
    text, stats = speculative_sample(cfg, params, dcfg, dparams, tok, g, g.prompt, args.gamma)
    print(g.prompt + text)
    print(f"speculative: {int(stats['accepted'])} of {int(stats['proposed'])} draft tokens "
          f"accepted in {int(stats['steps'])} target calls", file=sys.stderr)
    return 0


def with_adapters(model_cfg, params, adapters_dir: str, flag: str = "--adapters"):
    """`params` with a saved LoRA adapter folder merged in (W + alpha/r A B), after checking
    that the adapters fit this model's projections."""
    from gendist.training import lora
    t, adapters, _ = lora.load(adapters_dir, flag)
    lora.check_fits(adapters, model_cfg, t, f"{flag} {adapters_dir}")
    print(f"adapters: {adapters_dir} (rank {t.lora_rank}, alpha {t.lora_alpha}, "
          f"targets {t.lora_targets}) merged", file=sys.stderr)
    return lora.merge_into(params, adapters, t)


def _model_dir_config(model_dir: str, flag: str, base):
    """The ModelConfig of a Hugging Face directory's config.json (no weights read yet)."""
    from gendist import hf
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"{flag} {model_dir!r} is not a directory; give a Hugging "
                                "Face Llama directory (config.json + *.safetensors), e.g. "
                                "one `python -m gendist export` wrote.")
    return hf.model_config_from_hf(hf.read_config(model_dir), base)


def sample(model_cfg, params, tok, g: GenerateConfig, prompts: list[str]) -> list[str]:
    """Continuations of `prompts` with a tokenizer (stops at g.eos_id, else the tokenizer's),
    decoded on `g.path` with `g.head`'s output layer (`decoder.plan`); the path line and the
    decode speed go to stderr."""
    import time

    import jax
    import jax.numpy as jnp

    from gendist.inference import decoder
    from gendist.inference.generate import generate, pad_prompts
    from gendist.inference.sampling import SamplingParams
    eos = g.eos_id if g.eos_id >= 0 or tok.eos_id is None else tok.eos_id
    prompt_BT, len_B = pad_prompts(check_prompt(model_cfg, tok, g, prompts))
    B, T = prompt_BT.shape
    plan = decoder.plan(model_cfg, params, B, T + g.max_new_tokens, g.path, head=g.head,
                        kernel_state=g.kernel_state)
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
    explicit "megakernel" is the draft's (a token a call; greedy, the tokens after its first in
    one kernel launch where its plan takes greedy steps), the target then takes "auto" (it
    verifies gamma + 1 tokens a call)."""
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


def run_tokenizer(run_dir: str):
    """The tokenizer a run trained with (its saved config.yaml, beside checkpoints/), or bytes."""
    from gendist import config_yaml
    from gendist.data.tokenizer import load_tokenizer
    run = Path(run_dir)
    if run.name == "checkpoints" and not (run / "checkpoints").is_dir():
        run = run.parent  # given the run's checkpoints/ folder
    saved = run / config_yaml.YAML_NAME
    return load_tokenizer(config_yaml.load(saved).data.tokenizer if saved.is_file() else "bytes")


