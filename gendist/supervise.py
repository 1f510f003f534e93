"""Keeping a running multi-process job together: a step watchdog, stopping on a signal at one
step for every process, and what a survivor says when a peer is lost (joining the job:
`gendist.distributed`).

A lost peer must not hang the others: JAX's coordination service counts a process dead
after `heartbeat_timeout` seconds without heartbeats and ends the survivors, and a
collective whose peer vanished fails at once (gloo on CPU); `Watchdog` adds a per-step
deadline on top for hangs that neither notices.

Stopping on a signal: `StopRequest` turns SIGINT and SIGTERM into a request to stop at the
next step boundary (a second signal ends the process at once), and `Agreement` makes every
process of a job stop, or checkpoint on process 0's clock, at the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from gendist import distributed


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
    cfg = distributed.active_config()
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
