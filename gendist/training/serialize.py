"""Load a trained model's config and parameters from a checkpoint, for inference."""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import SingleDeviceSharding

from gendist.config import ModelConfig, deferred_checks
from gendist.models import transformer
from gendist.presets import config_from_dict
from gendist.training import fp8_scaling, lora, optim
from gendist.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    _quiet_orbax_leftovers,
    damage,
)


def find_checkpoint_dir(path: str | Path, flag: str = "--checkpoint") -> Path:
    """Accept a run's out_dir or its `checkpoints/` folder (`flag`: the option that named
    it, for the message)."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if not p.is_dir():
        raise CheckpointError(f"{flag} {str(path)!r} is not a directory; pass a run's "
                              "out_dir (e.g. runs/default) or its checkpoints/ folder.")
    return p


def load_params(path: str | Path, step: int | None = None, flag: str = "--checkpoint"
                ) -> tuple[ModelConfig, dict, int]:
    """(model config, params on the first local device, step) from a checkpoint. A missing
    or damaged one raises CheckpointError in one line naming `flag` and the fix."""
    ckpt = Checkpointer(find_checkpoint_dir(path, flag))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{flag} {str(path)!r}: no checkpoint found in "
                                  f"{ckpt.directory}; train first (python -m gendist train "
                                  "--train.out-dir DIR).")
        _quiet_orbax_leftovers()  # a failed read's leftovers (asyncio, threads) stay quiet
        try:
            meta = ckpt.manager.restore(step, args=_meta_args())["meta"]
            with deferred_checks():  # a run's saved training options need not pass today's checks
                cfg = config_from_dict(meta["config"])
            cfg.model.check()
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the fix
            raise CheckpointError(_damaged(ckpt, step, path, flag, e)) from e
        dev = SingleDeviceSharding(jax.local_devices()[0])
        opt = optim.make_optimizer(cfg.train)

        def init():  # the train state's layout (train.Setup.init_state), for its shapes
            params = transformer.init_params(cfg.model, 0)
            if lora.enabled(cfg):
                ad = lora.init(cfg.model, cfg.train, 0)
                state = {"params": ad, "opt_state": opt.init(ad),
                         "base": lora.base_params(params, cfg.train)}
            else:
                state = {"params": params, "opt_state": opt.init(params)}
                if cfg.train.objective == "dpo":
                    state["reference"] = params
            if fp8_scaling.enabled(cfg):
                state["fp8"] = fp8_scaling.init(cfg)
            return {"step": jax.numpy.zeros((), jax.numpy.int32), **state}

        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
                                jax.eval_shape(init))
        try:
            state, _, step = ckpt.restore(abstract, step)
        except CheckpointError as e:
            raise CheckpointError(_damaged(ckpt, step, path, flag, e.__cause__ or e)) from e
    finally:
        ckpt.close()
    if lora.enabled(cfg):  # a LoRA run: its model is the base with the adapters merged
        return cfg.model, lora.merge_into(state["base"], state["params"], cfg.train), step
    return cfg.model, state["params"], step


def _damaged(ckpt: Checkpointer, step: int, path, flag: str, e: BaseException) -> str:
    earlier = [s for s in ckpt.all_steps() if s < step]
    back = (f"move {ckpt.directory / str(step)} out of {ckpt.directory} to use step "
            f"{max(earlier)}, or " if earlier else "")
    return (f"{flag} {str(path)!r}: checkpoint step {step} in {ckpt.directory} is damaged or "
            f"partial ({damage(e)}); {back}train the run again into a new --train.out-dir.")


def _meta_args():
    import orbax.checkpoint as ocp
    return ocp.args.Composite(meta=ocp.args.JsonRestore())
