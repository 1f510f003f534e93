"""Load a trained model's config and parameters from a checkpoint, for inference."""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import SingleDeviceSharding

from gendist.config import ModelConfig
from gendist.models import transformer
from gendist.presets import config_from_dict
from gendist.training import optim
from gendist.training.checkpoint import Checkpointer, CheckpointError


def find_checkpoint_dir(path: str | Path) -> Path:
    """Accept a run's out_dir or its `checkpoints/` folder."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if not p.is_dir():
        raise CheckpointError(f"--checkpoint {str(path)!r} is not a directory; pass a run's "
                              "out_dir (e.g. runs/default) or its checkpoints/ folder.")
    return p


def load_params(path: str | Path, step: int | None = None) -> tuple[ModelConfig, dict, int]:
    """(model config, params on the first local device, step) from a checkpoint."""
    ckpt = Checkpointer(find_checkpoint_dir(path))
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint found in {ckpt.directory}; train first "
                              "(python -m gendist train --train.out-dir DIR).")
    meta = ckpt.manager.restore(step, args=_meta_args())["meta"]
    cfg = config_from_dict(meta["config"])
    dev = SingleDeviceSharding(jax.local_devices()[0])
    opt = optim.make_optimizer(cfg.train)

    def init():
        params = transformer.init_params(cfg.model, 0)
        return {"step": jax.numpy.zeros((), jax.numpy.int32), "params": params,
                "opt_state": opt.init(params)}

    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
                            jax.eval_shape(init))
    state, _, step = ckpt.restore(abstract, step)
    ckpt.close()
    return cfg.model, state["params"], step


def _meta_args():
    import orbax.checkpoint as ocp
    return ocp.args.Composite(meta=ocp.args.JsonRestore())
