"""A local launcher for N processes of one job (`python -m gendist launch`).

Each process gets the GENDIST_* variables that `gendist.distributed.maybe_initialize` reads
(a free coordinator port on this host, its rank, its devices: simulated CPU devices or a
slice of the GPUs); their output is relayed line by line with a `[rank]` prefix; the first
failure ends them all, and SIGINT/SIGTERM sent to the launcher are relayed to every process.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from gendist.distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from gendist.supervise import STOP_SIGNALS


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on `host` (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_device_flags(xla_flags: str, devices: int) -> str:
    """`xla_flags` with its simulated CPU device count set to `devices` (any other flag kept)."""
    flags = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def child_env(rank: int, nproc: int, coordinator: str, devices_per_process: int | None,
              gpus_per_process: int | None, base=None) -> dict:
    """The environment of local process `rank`: GENDIST_* plus its devices."""
    env = dict(os.environ if base is None else base)
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(nproc),
                ENV_PROCESS_ID: str(rank), "PYTHONUNBUFFERED": "1"})
    if devices_per_process:
        env["XLA_FLAGS"] = host_device_flags(env.get("XLA_FLAGS", ""), devices_per_process)
        env["JAX_PLATFORMS"] = "cpu"
    if gpus_per_process:
        ids = range(rank * gpus_per_process, (rank + 1) * gpus_per_process)
        env[ENV_LOCAL_DEVICE_IDS] = ",".join(map(str, ids))
    return env


def launch(command: list[str], nproc: int, devices_per_process: int | None = None,
           gpus_per_process: int | None = None, grace: float = 5.0, out=None,
           stop_grace: float = 60.0) -> int:
    """Run `command` as `nproc` local processes of one job; the first failure ends all.

    Each process runs in its own session, so a terminal's Ctrl-C reaches only the launcher:
    SIGINT and SIGTERM sent to it are relayed to every process (gendist train then stops all
    of them at one agreed step, after a checkpoint; a second signal stops them at once). A
    process that stopped on a signal (exit code 130 or 143) is no failure to stop the others
    for: they get `stop_grace` seconds to stop at the same step. Returns 0 when every
    process exits 0, else the first non-zero exit code (128+signal for a killed process).
    """
    if nproc < 1:
        raise ValueError(f"launch --nproc={nproc} must be >= 1.")
    if not command:
        raise ValueError("launch needs a command after `--`, e.g. "
                         "`python -m gendist launch --nproc 2 -- python -m gendist train`.")
    out = sys.stdout if out is None else out
    coordinator = f"127.0.0.1:{free_port()}"
    procs, pumps, relayed = [], [], []

    def relay(signum, frame):
        relayed.append(signum)
        _signal_all(procs, signum)

    restore = _handle_stop_signals(relay)
    try:
        for rank in range(nproc):
            env = child_env(rank, nproc, coordinator, devices_per_process, gpus_per_process)
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            pumps.append(threading.Thread(target=_pump, args=(rank, procs[-1], out),
                                          daemon=True))
            pumps[-1].start()
        failed = _wait(procs, relayed, grace, stop_grace, out)
    except KeyboardInterrupt:  # the launcher could not take over SIGINT (not the main thread)
        _terminate(procs, grace)
        return 130
    finally:
        restore()
    for t in pumps:
        t.join(timeout=grace)
    return 0 if failed is None else _exit_code(procs[failed].returncode)


STOPPED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a process that stopped on a signal


def _wait(procs: list[subprocess.Popen], relayed: list[int], grace: float, stop_grace: float,
          out) -> int | None:
    """Wait for every process; the rank of the first that failed (None: all exited 0).

    A failure stops the others at once, a stop on a signal after `stop_grace` s, a second
    relayed signal after `grace` s."""
    failed, deadline, escalated = None, None, False
    while [p.poll() for p in procs].count(None):  # poll every one: that sets returncode
        now = time.monotonic()
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.returncode), None)
            if failed is not None:
                rc = procs[failed].returncode
                stopped = bool(relayed) or rc in STOPPED_CODES
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"code {rc}"
                out.write(f"[launch] process {failed} exited with {how}; " + (
                    f"waiting up to {stop_grace:.0f}s for the other {len(procs) - 1} to stop"
                    if stopped else f"stopping the other {len(procs) - 1}") + "\n")
                out.flush()
                deadline = now + (stop_grace if stopped else 0.0)
        if len(relayed) >= 2 and not escalated:
            escalated, deadline = True, min(deadline or math.inf, now + grace)
        if deadline is not None and now >= deadline:
            _terminate(procs, grace)
            break
        time.sleep(0.1)
    return failed if failed is not None else next(
        (r for r, p in enumerate(procs) if p.returncode), None)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _handle_stop_signals(handler):
    """Install `handler` for SIGINT and SIGTERM (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}

    def restore():
        for s, h in old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
    return restore


def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
    """Send `signum` to the process groups we started that are still running."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(p.pid, signum)


# Gloo prints one line per pair of connected devices at start-up (C++, not maskable), from
# several threads at once: two such lines can interleave piece by piece, as
# "[Gloo] Rank 0 ... peer ranks is : [Gloo] Rank 0 ... peer ranks is : 1\n1\n", whose
# second line ("1") is the tail of the first message.
_GLOO = b"[Gloo] Rank "
_GLOO_PIECE = re.compile(rb"\[Gloo\] Rank |\d+| is connected to | peer ranks\. ?|"
                         rb"Expected number of connected peer ranks is ?: ?|\s+")


def _pump(rank: int, proc: subprocess.Popen, out):
    owed = 0  # lines still to come that finish interleaved Gloo messages
    for line in iter(proc.stdout.readline, b""):
        n = line.count(_GLOO)
        if n or (owed and not _GLOO_PIECE.sub(b"", line)):
            owed = max(owed + n - 1, 0)  # each message ends one line
            continue
        owed = 0  # the tails come straight after their line (one flush of C++'s buffer)
        out.write(f"[{rank}] " + line.decode(errors="replace"))
        out.flush()


def _terminate(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM the process groups we started, then SIGKILL what is left after `grace` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal_all(procs, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
