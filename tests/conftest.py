"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

The tests' programs are small: compiling them is most of the suite's time, so the CPU
backend compiles without LLVM's optimisation passes (about 1.8x faster overall). Codegen
only, no fast-math, but the order of a vectorised sum may differ from an optimised build:
a bitwise comparison must compare two programs built with the same flags, so subprocesses
(CLI, multi-process, notebooks) inherit them. A flag already in $XLA_FLAGS wins.

Many tests compile the same programs (the same small model's step in several tests, a CLI
subprocess after its in-process twin, the two xdist workers): jax's persistent compilation
cache, in one temporary directory per run shared by the workers and the subprocesses through
$JAX_COMPILATION_CACHE_DIR, compiles each once. Every program is cached (no minimum compile
time). A directory already in $JAX_COMPILATION_CACHE_DIR is used as is (and kept).
"""
import os
import shutil
import tempfile

_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f for f in _FLAGS if f.split("=")[0] not in _given]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run: xdist's
    _OWN_CACHE = tempfile.mkdtemp(prefix="gendist-test-jax-cache-")  # workers inherit it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Tests that take a third of a minute or more on 2 cores (the CI log's slowest durations).
_LONG = ("test_readme_commands_run_in_order", "test_persistent_backward_equals_one_block_per_tile",
         "test_per_sequence_acceptance_equals_running_alone", "test_killed_process_ends_the_other",
         "test_init_from_hf_on_zero3_mesh", "test_two_processes_equal_one_process",
         "test_two_gpu_table_runs_tiny_on_cpu", "test_sigterm_to_one_process_stops_the_job",
         "test_sigterm_checkpoints_the_step_reached")


def pytest_collection_modifyitems(config, items):
    """The long tests and the notebooks first: xdist hands tests out in this order, so the
    run does not end with one worker busy on a long test while the other waits."""
    def long(item):
        return (item.get_closest_marker("slow") is not None or item.path.suffix == ".ipynb"
                or any(name in item.name for name in _LONG))
    items.sort(key=lambda item: not long(item))
