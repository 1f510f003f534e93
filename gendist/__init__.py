"""gendist: distributed training and fast decoding of transformers as one JAX SPMD program.

The Python API (imported on first use, so `import gendist` stays cheap):

    from gendist import Config, preset, replace, build, run, generate_text
    cfg = replace(preset("tiny"), **{"train.steps": 100, "train.out_dir": "runs/py"})
    result = run(cfg)                       # train (resumes out_dir), returns RunResult
    setup = build(cfg)                      # mesh, shardings, jitted step_fn / eval_fn

See README.md, "Use it from Python".
"""

from __future__ import annotations

import importlib

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("gendist")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

_EXPORTS = {
    "Config": "gendist.config", "ModelConfig": "gendist.config", "MeshConfig": "gendist.config",
    "DataConfig": "gendist.config", "TrainConfig": "gendist.config",
    "GenerateConfig": "gendist.config", "preset": "gendist.presets", "replace": "gendist.presets",
    "build": "gendist.training.train", "Setup": "gendist.training.train",
    "run": "gendist.training.loop", "RunResult": "gendist.training.loop",
    "generate_text": "gendist.inference.generate",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gendist' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
