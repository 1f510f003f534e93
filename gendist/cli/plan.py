"""`plan`: predicted against compiled per-device memory and communication (and the
pipeline bubble) for a config, on simulated CPU devices if asked."""

from __future__ import annotations

import dataclasses
import os
from typing import Annotated

import tyro

from gendist.cli.args import UsageError, parse_with_config
from gendist.config import Config


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    config: Annotated[Config, tyro.conf.arg(name="")]
    devices: int = 0  # simulate this many CPU devices (0: the devices there are)
    no_compile: bool = False  # print the predictions only (nothing compiled)


def cmd_plan(argv: list[str]) -> int:
    args = parse_with_config(PlanArgs, argv, "plan", "gendist plan: predicted vs compiled "
                             "memory and communication for a config.")
    if not 0 <= args.devices <= 4096:
        raise UsageError(f"--devices {args.devices}: give a number of simulated devices from 1 "
                         "to 4096, e.g. 8 (0: the devices there are)")
    if args.devices:  # simulated CPU devices; must be set before the first backend call
        from gendist.launcher import host_device_flags
        os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), args.devices)
    from gendist.accounting import plan_report
    print(plan_report(args.config, compile_step=not args.no_compile))
    return 0
