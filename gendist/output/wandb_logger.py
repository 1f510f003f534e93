"""Optional Weights & Biases logging beside JSONL and TensorBoard (extra `[wandb]`).

`train.wandb=offline` writes the run under `out_dir/wandb/` with no network (upload later
with `wandb sync out_dir/wandb/offline-run-*`); `online` logs live. The W&B run id is kept
in `out_dir/wandb_run_id`, so a resumed training run continues the same W&B run.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from pathlib import Path


class WandbLogger:
    def __init__(self, out_dir: Path, cfg, mode: str, project: str):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(f"train.wandb={mode!r} needs the wandb package: "
                              "pip install 'gendist[wandb]' (or set --train.wandb off).") from e
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        id_file = out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg or {})
        self.run = wandb.init(project=project, dir=str(out_dir), mode=mode, id=run_id,
                              resume="allow", config=config, name=out_dir.name,
                              settings=wandb.Settings(console="off", silent=True))

    def write(self, step: int, metrics: dict) -> None:
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if scalars:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
