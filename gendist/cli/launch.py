"""`launch`: N local processes of one multi-process job (development and tests)."""

from __future__ import annotations

import dataclasses

from gendist.cli.args import UsageError, parse


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    """Start N processes of one multi-process job on this machine: launch --nproc N
    [options] -- COMMAND .... Each gets GENDIST_COORDINATOR/NUM_PROCESSES/PROCESS_ID (read
    by gendist.distributed.maybe_initialize); output lines are prefixed with [rank]; when
    one process fails the others are stopped and the launcher exits with its code."""

    nproc: int  # processes to start
    devices_per_process: int | None = None  # simulate D CPU devices per process (JAX_PLATFORMS=cpu, gloo)
    gpus_per_process: int | None = None  # process i owns GPUs i*G .. i*G+G-1 (GENDIST_LOCAL_DEVICE_IDS)


def cmd_launch(argv: list[str]) -> int:
    from gendist.launcher import launch
    split = argv.index("--") if "--" in argv else len(argv)
    a = parse(LaunchArgs, argv[:split], "launch", description=LaunchArgs.__doc__)
    for flag, value in (("--nproc", a.nproc), ("--devices-per-process", a.devices_per_process),
                        ("--gpus-per-process", a.gpus_per_process)):
        if value is not None and not 1 <= value <= 4096:
            raise UsageError(f"{flag} {value}: give a count from 1 to 4096 (e.g. {flag} 2)")
    return launch(argv[split + 1:], a.nproc, a.devices_per_process, a.gpus_per_process)
