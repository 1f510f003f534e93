"""Multi-host initialisation (`jax.distributed`), a step watchdog, and stopping on a signal at
one step for every process (the local launcher of N processes: `gendist.launcher`).

One training program runs as one process per host (or per GPU); `jax.distributed` joins them
into one runtime whose devices form one global mesh. Processes find each other through
explicit options (`DistributedConfig`, or the GENDIST_* variables that `launch` sets), or
through the cluster's own environment (SLURM, Open MPI), which JAX reads itself.

A lost peer must not hang the others: JAX's coordination service counts a process dead
after `heartbeat_timeout` seconds without heartbeats and ends the survivors, and a
collective whose peer vanished fails at once (gloo on CPU); `Watchdog` adds a per-step
deadline on top for hangs that neither notices.

Stopping on a signal: `StopRequest` turns SIGINT and SIGTERM into a request to stop at the
next step boundary (a second signal ends the process at once), and `Agreement` makes every
process of a job stop, or checkpoint on process 0's clock, at the same step.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import socket
import sys
import threading
import time
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


class Watchdog:
    """Ends the process when a step takes longer than `timeout` seconds (a hung collective).

    The heartbeat timeout catches dead processes; this catches the rest (a peer that is
    alive but stuck, a network partition that keeps TCP open). It exits non-zero with a
    message instead of hanging until the cluster's wall-clock limit. The clock starts at
    the first `beat`, so compiling the first step is not timed.
    """

    def __init__(self, timeout: float, what: str = "training step"):
        if timeout <= 0:
            raise ValueError(f"watchdog timeout={timeout} must be a positive number of seconds.")
        self.timeout, self.what = timeout, what
        self._last: float | None = None  # unarmed until the first beat
        self._label = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="gendist-watchdog")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def beat(self, label: str) -> None:
        """Progress was made (`label` names it in the failure message)."""
        self._last, self._label = time.monotonic(), label

    def _watch(self):
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if self._last is None:
                continue
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                _die(f"no progress for {idle:.0f}s after {self._label} (watchdog timeout "
                     f"{self.timeout:.0f}s on {self.what}): another process is probably dead "
                     "or stuck; see its log. Rerun to resume from the last complete checkpoint.")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """While active, SIGINT and SIGTERM ask the training loop to stop at its next step
    boundary: the first sets `signum`; a second ends the process at once (exit code 128 +
    its number), printing `saved` (where the last complete checkpoint is).

    A thread reads the signals from `signal.set_wakeup_fd`, so the second one works while
    the main thread waits inside XLA (a compile, a hung collective). Outside the main thread
    it does nothing and the signals keep their handlers.
    """

    def __init__(self):
        self.signum = 0
        self.saved = "no checkpoint yet"
        self._old: dict | None = None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old = {s: signal.signal(s, _ignore_signal) for s in STOP_SIGNALS}
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._read, args=(read,), daemon=True,
                         name="gendist-signals").start()
        return self

    def __exit__(self, *exc):
        if self._old is None:
            return
        for s, handler in self._old.items():  # None: a handler not set from Python
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write)  # the reader sees end-of-file and ends
        self._old = None

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                for signum in data:  # one byte per signal delivered
                    if signum in STOP_SIGNALS:
                        self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            _say(f"second {name}: stopping now without saving; {self.saved}.")
            os._exit(128 + signum)
        self.signum = signum
        _say(f"{name}: saving a checkpoint at the next step boundary, then stopping "
             f"({name} again stops at once without saving).")


def _ignore_signal(signum, frame) -> None:
    """The Python-level handler of StopRequest's signals: its thread acts on them."""


def _say(line: str) -> None:
    sys.stderr.write(f"gendist: {line}\n")
    sys.stderr.flush()


class Agreement:
    """What every process decides together at a step boundary: stop (a stop signal reached
    some process; the largest signal number wins) and checkpoint now (process 0's clock).

    One process decides at every step without communicating. Several all-gather three
    integers at agreed steps only: about every `every_s` seconds of process 0's step time
    and at most `max_gap` steps apart (the gap to the next agreed step travels with each
    decision, so all processes take part in the same all-gathers); a signal is acted on
    within about a second or `max_gap` steps. Measured (2 processes x 2 CPU devices, gloo,
    16 cores, the test model): an all-gather after every 15 ms step adds 1.0 ms, so one
    per 20 steps at most adds 0.05 ms a step (0.3%), and less for longer steps.
    """

    def __init__(self, step: int, every_s: float = 1.0, max_gap: int = 20):
        import jax
        self.processes = jax.process_count()
        self.every_s, self.max_gap = every_s, max_gap
        self.next = step + 1  # the first agreed step
        self._t, self._step = time.monotonic(), step
        self.agreements = 0

    def decide(self, step: int, signum: int, save_due: bool) -> tuple[int, bool]:
        """(signal number to stop on or 0, checkpoint now) agreed at `step`."""
        if self.processes == 1:
            return signum, save_due
        if step < self.next:
            return 0, False
        import numpy as np
        from jax.experimental import multihost_utils
        now = time.monotonic()
        per_step = (now - self._t) / max(step - self._step, 1)
        gap = int(min(max(self.every_s / max(per_step, 1e-6), 1), self.max_gap))
        self._t, self._step = now, step
        rows = multihost_utils.process_allgather(np.array([signum, save_due, gap], np.int32))
        self.next = step + int(rows[0, 2])
        self.agreements += 1
        return int(rows[:, 0].max()), bool(rows[0, 1])


def is_runtime_error(e: BaseException) -> bool:
    """An error raised by the XLA runtime (a failed collective), not by Python code."""
    return type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError")


def lost_peer_message(e: BaseException, last_checkpoint: int | None, directory) -> str:
    """What a survivor prints when a cross-process collective fails mid-run."""
    import jax
    cfg = _active or DistributedConfig.from_env()
    where = ("no checkpoint yet" if last_checkpoint is None
             else f"the last complete checkpoint is step {last_checkpoint} in {directory}")
    return (f"gendist: process {jax.process_index()}/{jax.process_count()}: a collective with "
            f"the other processes failed ({str(e).splitlines()[0][:300]}). Another process most "
            f"likely died: JAX's coordination service names it (\"Task N heartbeat timeout\") "
            f"within heartbeat_timeout={cfg.heartbeat_timeout}s and ends this process. {where}; "
            "rerun the same command to resume from it.")


def _die(msg: str) -> None:
    """Exit at once, skipping atexit hooks that would wait on the lost peers."""
    import jax
    print(f"gendist: process {jax.process_index()}/{jax.process_count()}: {msg}",
          file=sys.stderr, flush=True)
    os._exit(3)
