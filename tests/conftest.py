"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

The tests' programs are small: compiling them is most of the suite's time, so the CPU
backend compiles without LLVM's optimisation passes (about 1.8x faster overall). Codegen
only, no fast-math, but the order of a vectorised sum may differ from an optimised build:
a bitwise comparison must compare two programs built with the same flags, so subprocesses
(CLI, multi-process, notebooks) inherit them. A flag already in $XLA_FLAGS wins.
"""
import os

_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f for f in _FLAGS if f.split("=")[0] not in _given]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
