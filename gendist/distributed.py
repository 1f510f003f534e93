"""Joining a multi-host job (`jax.distributed`): its options, the cluster's environment, and a
clear error when the processes do not meet (the local launcher of N processes:
`gendist.launcher`; keeping a running job together: `gendist.supervise`).

One training program runs as one process per host (or per GPU); `jax.distributed` joins them
into one runtime whose devices form one global mesh. Processes find each other through
explicit options (`DistributedConfig`, or the GENDIST_* variables that `launch` sets), or
through the cluster's own environment (SLURM, Open MPI), which JAX reads itself.

A lost peer must not hang the others: JAX's coordination service counts a process dead
after `heartbeat_timeout` seconds without heartbeats (set here) and ends the survivors.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import sys
import threading
from dataclasses import dataclass

ENV_COORDINATOR = "GENDIST_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "GENDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "GENDIST_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "GENDIST_LOCAL_DEVICE_IDS"  # e.g. "0,1,2,3": the GPUs this process uses
ENV_INIT_TIMEOUT = "GENDIST_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "GENDIST_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "GENDIST_SHUTDOWN_TIMEOUT"
ENV_AUTO = "GENDIST_AUTO_DISTRIBUTED"  # "1": call jax.distributed.initialize() bare (k8s, TPU)


_active: DistributedConfig | None = None  # the options this process joined with


class DistributedError(RuntimeError):
    """A process could not join, or lost, the multi-process job."""


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process job; None fields are left to JAX to detect."""

    coordinator_address: str | None = None  # host:port where process 0 serves coordination
    num_processes: int | None = None  # processes in the job (all hosts together)
    process_id: int | None = None  # this process's rank in [0, num_processes)
    local_device_ids: tuple[int, ...] | None = None  # accelerators this process owns (None: all)
    initialization_timeout: int = 300  # s to wait for every process to connect
    heartbeat_timeout: int = 100  # s without a heartbeat before a process counts as dead
    shutdown_timeout: int = 60  # s the exit barrier waits for the other processes
    cpu_collectives: str = "gloo"  # cross-process collectives between CPU devices

    def __post_init__(self):
        explicit = (self.coordinator_address, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and None in explicit:
            raise ValueError(
                "DistributedConfig: give coordinator_address, num_processes and process_id "
                f"together (got {explicit}); set all three ({ENV_COORDINATOR}, "
                f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}) or none to let JAX detect them.")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise ValueError(f"DistributedConfig.coordinator_address="
                             f"{self.coordinator_address!r} needs a port: use HOST:PORT.")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"DistributedConfig.num_processes={self.num_processes} must be >= 1.")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"DistributedConfig.process_id={self.process_id} must lie in "
                             f"[0, num_processes={self.num_processes}).")
        for name in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DistributedConfig.{name}={getattr(self, name)} must be a "
                                 "positive number of seconds.")

    @property
    def explicit(self) -> bool:
        return self.coordinator_address is not None

    @classmethod
    def from_env(cls, environ=None) -> DistributedConfig:
        """Read the GENDIST_* variables (unset ones keep their defaults)."""
        env = os.environ if environ is None else environ
        kw: dict = {}
        if ENV_COORDINATOR in env:
            kw["coordinator_address"] = env[ENV_COORDINATOR]
        for var, name in ((ENV_NUM_PROCESSES, "num_processes"), (ENV_PROCESS_ID, "process_id"),
                          (ENV_INIT_TIMEOUT, "initialization_timeout"),
                          (ENV_HEARTBEAT_TIMEOUT, "heartbeat_timeout"),
                          (ENV_SHUTDOWN_TIMEOUT, "shutdown_timeout")):
            if var in env:
                kw[name] = _int_env(env, var)
        if env.get(ENV_LOCAL_DEVICE_IDS):
            kw["local_device_ids"] = tuple(
                _int_env({ENV_LOCAL_DEVICE_IDS: x}, ENV_LOCAL_DEVICE_IDS)
                for x in env[ENV_LOCAL_DEVICE_IDS].split(","))
        return cls(**kw)


def _int_env(env, var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ValueError(f"environment variable {var}={env[var]!r} must be an integer.") from None


def detect(environ=None) -> str | None:
    """Which launcher started this process: 'gendist', 'slurm', 'ompi', 'auto', or None.

    SLURM and Open MPI count only with more than one task, so a plain `python` inside an
    allocation (or a one-task step) trains as a single process instead of waiting for peers.
    """
    env = os.environ if environ is None else environ
    if ENV_COORDINATOR in env or ENV_NUM_PROCESSES in env or ENV_PROCESS_ID in env:
        return "gendist"
    if (all(v in env for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID",
                               "SLURM_LOCALID")) and int(env.get("SLURM_NTASKS", "1")) > 1):
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    if env.get(ENV_AUTO, "") == "1":
        return "auto"
    return None


def _supported_kwargs(cfg: DistributedConfig) -> dict:
    """initialize() kwargs this JAX accepts (the timeout names differ across versions)."""
    import jax
    params = inspect.signature(jax.distributed.initialize).parameters
    wanted = {"initialization_timeout": cfg.initialization_timeout,
              "heartbeat_timeout_seconds": cfg.heartbeat_timeout,
              "shutdown_timeout_seconds": cfg.shutdown_timeout}
    if cfg.explicit:
        wanted.update(coordinator_address=cfg.coordinator_address,
                      num_processes=cfg.num_processes, process_id=cfg.process_id)
    if cfg.local_device_ids is not None:
        wanted["local_device_ids"] = list(cfg.local_device_ids)
    return {k: v for k, v in wanted.items() if k in params}


def maybe_initialize(cfg: DistributedConfig | None = None, environ=None) -> bool:
    """Join the multi-process job this process was started in; False when there is none.

    Call before any other JAX call (jax.devices() included). Explicit `cfg` fields win over
    GENDIST_* variables; with neither, SLURM / Open MPI / GENDIST_AUTO_DISTRIBUTED=1 hand
    the detection to `jax.distributed.initialize()`.
    """
    import jax
    if jax.distributed.is_initialized():
        return True
    env = os.environ if environ is None else environ
    how = "explicit" if cfg is not None and cfg.explicit else detect(env)
    if how is None:
        return False
    cfg = cfg if cfg is not None else DistributedConfig.from_env(env)
    if how in ("gendist", "explicit") and not cfg.explicit:
        raise ValueError(f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be "
                         "set together; `python -m gendist launch` sets all three.")
    # Harmless for GPU/TPU runs: it only picks how CPU devices talk across processes.
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    # JAX's preemption notifier would catch SIGTERM and carry on (the process ignores it);
    # the training loop handles SIGTERM itself (StopRequest), and elsewhere it ends a process.
    with contextlib.suppress(AttributeError):  # a JAX without the option
        jax.config.update("jax_enable_preemption_service", False)
    where = (f"coordinator {cfg.coordinator_address} as process {cfg.process_id} of "
             f"{cfg.num_processes}" if cfg.explicit else f"the {how} environment")
    fix = (f"Start every process with the same {ENV_COORDINATOR} (process 0's host:port, "
           f"reachable through the firewall), or raise {ENV_INIT_TIMEOUT}.")
    kwargs = _supported_kwargs(cfg)
    # JAX aborts the process (no Python error) when its own timeout passes; give it a few
    # more seconds so that our deadline fires first, with a message that says why.
    if "initialization_timeout" in kwargs:
        kwargs["initialization_timeout"] += 10
    joined = threading.Event()
    threading.Thread(target=_init_deadline, args=(joined, cfg, where, fix), daemon=True,
                     name="gendist-init-deadline").start()
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # noqa: BLE001 - XLA raises its own runtime error types
        raise DistributedError(
            f"could not join the multi-process job through {where} within "
            f"initialization_timeout={cfg.initialization_timeout}s: {_why_not_joined(cfg)} "
            f"({type(e).__name__}: {str(e)[:400]}). {fix}") from e
    finally:
        joined.set()
    _compile_afresh_on_cpu()
    global _active
    _active = cfg
    return True


def _compile_afresh_on_cpu():
    """A multi-process job on CPU devices does not use jax's persistent compilation cache.
    With jax 0.12.1 a program with cross-process collectives (gloo) hangs on its first run
    when it comes from the cache, whether every process loaded it or only one: a jitted
    gradient step over a data 4 x tensor 2 mesh of 2 processes x 4 CPU devices does, run
    twice with one cache (jax 0.12.0 runs it; compiled afresh, 0.12.1 too), and so did
    gendist's 2-process training. CPU jobs of several processes are tests and rehearsals of
    small programs: compiling afresh costs seconds. GPU and TPU jobs keep the cache."""
    import jax
    if (jax.process_count() > 1 and jax.default_backend() == "cpu"
            and jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        jax.config.update("jax_enable_compilation_cache", False)


def _init_deadline(joined: threading.Event, cfg: DistributedConfig, where: str, fix: str):
    if joined.wait(cfg.initialization_timeout):
        return
    print(f"gendist: DistributedError: could not join the multi-process job through {where} "
          f"within initialization_timeout={cfg.initialization_timeout}s: "
          f"{_why_not_joined(cfg)}. {fix}", file=sys.stderr, flush=True)
    os._exit(2)


def _why_not_joined(cfg: DistributedConfig) -> str:
    """Why initialisation failed, in words: nobody at the address, or someone missing."""
    if not cfg.explicit:
        return "not all of the cluster environment's processes started"
    if cfg.process_id == 0:
        return (f"the coordinator runs here, but not all {cfg.num_processes} processes "
                "connected to it")
    host, _, port = cfg.coordinator_address.rpartition(":")
    address = cfg.coordinator_address
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return (f"{address} accepts connections, but not all processes joined (another "
                    "process is missing, or a different job owns that port)")
    except OSError as e:
        return f"nothing answers at {address} ({e.strerror or e}): process 0 is not running there"


def active_config() -> DistributedConfig:
    """The options this process joined its job with (the environment's when it joined through
    the cluster's own detection, or has not joined)."""
    return _active or DistributedConfig.from_env()
