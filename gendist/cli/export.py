"""`export`: a run's checkpoint as a Hugging Face Llama directory."""

from __future__ import annotations

import dataclasses
from typing import Literal

from gendist.cli.args import parse


@dataclasses.dataclass(frozen=True)
class ExportArgs:
    """Write a run's latest checkpoint as a Hugging Face Llama directory (config.json,
    safetensors, the tokenizer)."""

    checkpoint: str  # a run's train.out_dir (e.g. runs/default) or its checkpoints/ folder
    out: str  # the model directory to write
    dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the saved weights
    tokenizer: str = ""  # a tokenizer file or "bytes" (default: the run's own)


def cmd_export(argv: list[str]) -> int:
    from gendist import hf
    from gendist.cli.generate import run_tokenizer
    from gendist.data.tokenizer import load_tokenizer
    from gendist.training.serialize import load_params
    a = parse(ExportArgs, argv, "export", description=ExportArgs.__doc__)
    model_cfg, params, step = load_params(a.checkpoint)
    tok = load_tokenizer(a.tokenizer) if a.tokenizer else run_tokenizer(a.checkpoint)
    names = hf.save(a.out, model_cfg, params, dtype=a.dtype, tokenizer=tok)
    print(f"exported step {step} ({model_cfg.num_params / 1e6:.2f}M params) to {a.out}: "
          f"{', '.join(names)}")
    return 0
