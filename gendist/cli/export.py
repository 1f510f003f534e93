"""`export`: a run's checkpoint as a Hugging Face Llama directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from gendist.cli.args import parse


@dataclasses.dataclass(frozen=True)
class ExportArgs:
    """Write a run's latest checkpoint as a Hugging Face Llama directory (config.json,
    safetensors, the tokenizer: a byte-level run's as gendist_tokenizer.json). A folder
    that holds files is refused unless --overwrite, which replaces it whole."""

    checkpoint: str  # a run's train.out_dir (e.g. runs/default) or its checkpoints/ folder
    out: str  # the model directory to write (new or empty; --overwrite replaces one whole)
    dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the saved weights
    tokenizer: str = ""  # a tokenizer file or "bytes" (default: the run's own)
    adapters: str = ""  # LoRA adapters folder merged into the weights (a LoRA run's own: always)
    overwrite: bool = False  # replace an existing --out folder whole (written beside it, then swapped in)


def cmd_export(argv: list[str]) -> int:
    from gendist import hf
    from gendist.cli.generate import check_tokenizer_fits, run_tokenizer
    from gendist.data.tokenizer import load_tokenizer
    from gendist.training.serialize import find_checkpoint_dir, load_params
    a = parse(ExportArgs, argv, "export", description=ExportArgs.__doc__)
    hf.check_target(a.out, a.overwrite, flag="--out")  # before reading the checkpoint
    out, run = Path(a.out).resolve(), find_checkpoint_dir(a.checkpoint).resolve()
    if out == run or out in run.parents:
        raise ValueError(f"--out {a.out!r} holds the run being exported (--checkpoint "
                         f"{a.checkpoint}); give --out a folder of its own, e.g. {a.out}-hf.")
    tok = load_tokenizer(a.tokenizer) if a.tokenizer else run_tokenizer(a.checkpoint)
    model_cfg, params, step = load_params(a.checkpoint)
    if a.adapters:
        from gendist.cli.generate import with_adapters
        params = with_adapters(model_cfg, params, a.adapters)
    check_tokenizer_fits(model_cfg, tok, "--tokenizer" if a.tokenizer else
                         f"the run's tokenizer ({tok.name})", f"--checkpoint {a.checkpoint}")
    names = hf.save(a.out, model_cfg, params, dtype=a.dtype, tokenizer=tok,
                    overwrite=a.overwrite)
    written = [*names, hf.CONFIG, *(Path(f).name for f in tok.files)]
    if tok.name == "bytes":
        from gendist.data.tokenizer import BYTES_FILE
        written.append(BYTES_FILE)
    print(f"exported step {step} ({model_cfg.num_params / 1e6:.2f}M params) to {a.out}: "
          f"{', '.join(written)}")
    return 0
