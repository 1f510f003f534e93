"""The collectives of a compiled step, read from XLA's optimized HLO text.

`parse_collectives` finds every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute with its payload, the mesh axes its replica groups span, and how many
times a step runs it (while-loop trip counts multiplied in); `comm_table` sums them by
(kind, axes). Payload is counted per device: the full buffer of an all-reduce, the gathered
output of an all-gather, the input of a reduce-scatter. A ring moves (n-1)/n of that per
device (twice for an all-reduce); `wire_bytes` converts. `gendist.accounting` sets these
beside what the config predicts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2,
               "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    axes: str  # mesh axes it spans, e.g. "tensor" or "data+tensor"
    payload: int  # bytes per device per execution (see module docstring)
    count: int  # executions per step (loop trip counts multiplied in)
    backward: bool  # belongs to the transposed (backward) computation
    shape: str


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_ARR = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")


def _array_bytes(text: str) -> list[int]:
    return [DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
            for d, dims in _ARR.findall(text)]


def _first_group(line: str, n: int) -> list[int]:
    """Device positions in the first replica group, from any of XLA's three notations."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in names]
        chosen = {a.split(":")[0].strip("' ") for a in m.group(2).split(",") if a.strip()}
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        index = tuple(slice(None) if a in chosen else 0 for a, _ in names)
        return ids[index].ravel().tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(",")))
        ids = ids.reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape)[0].tolist()
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return [int(x) for x in m.group(1).split(",") if x]
    return list(range(n))  # replica_groups={} : every device


def _axes(positions: list[int], mesh) -> str:
    coords = np.array([np.unravel_index(p, mesh.devices.shape) for p in positions])
    varying = [a for i, a in enumerate(mesh.axis_names) if len(set(coords[:, i])) > 1]
    return "+".join(varying) or "none"


def _permute_axes(line: str, mesh) -> str:
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
    moved = [p for p in pairs if p[0] != p[1]]
    axes = set()
    for s, t in moved:
        axes.update(a for a in _axes([int(s), int(t)], mesh).split("+") if a != "none")
    return "+".join(a for a in mesh.axis_names if a in axes) or "none"


def parse_collectives(hlo_text: str, mesh) -> list[Collective]:
    """Every collective of an optimized HLO module, with how often one step runs it."""
    comp, calls, found = None, {}, []
    n = mesh.devices.size
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            comp = m.group(1)
            if line.startswith("ENTRY"):
                calls.setdefault("__entry__", []).append((comp, 1))
            continue
        if " while(" in line:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            calls.setdefault(comp, []).append((body, int(trips.group(1)) if trips else 1))
        for key in ("calls", "to_apply", "true_computation", "false_computation"):
            for callee in re.findall(key + r"=%?([\w.\-]+)", line):
                calls.setdefault(comp, []).append((callee, 1))
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
            for callee in re.findall(r"%?([\w.\-]+)", group):
                calls.setdefault(comp, []).append((callee, 1))
        m = _OP.search(line)
        if not m or "-done(" in line:
            continue
        kind, sizes = m.group(2), _array_bytes(m.group(1))
        if m.group(3) and kind in ("all-gather", "collective-permute"):
            sizes = sizes[len(sizes) // 2:]  # async start: (operands, outputs, ...)
        if kind == "collective-permute":
            axes, group = _permute_axes(line, mesh), 1
        else:
            positions = _first_group(line, n)
            axes, group = _axes(positions, mesh), len(positions)
        payload = sum(sizes) * (group if kind == "reduce-scatter" else 1)
        found.append((comp, kind, axes, payload, "transpose(" in line, m.group(1)[:120]))
    mult = _multiplicities(calls)
    return [Collective(kind, axes, payload, mult.get(c, 0), bwd, shape)
            for c, kind, axes, payload, bwd, shape in found]


def _multiplicities(calls: dict) -> dict[str, int]:
    """How many times each computation runs per call of the entry (trip counts multiply)."""
    mult: dict[str, int] = {}

    def visit(comp, factor, depth=0):
        if depth > 64:
            return
        mult[comp] = mult.get(comp, 0) + factor
        for callee, k in calls.get(comp, ()):
            visit(callee, factor * k, depth + 1)

    for entry, _ in calls.get("__entry__", ()):
        visit(entry, 1)
    return mult


def comm_table(collectives, backward: bool | None = None) -> dict[tuple[str, str], int]:
    """Bytes per step by (kind, axes); `backward` selects one pass (None: both)."""
    out: dict[tuple[str, str], int] = {}
    for c in collectives:
        if c.axes == "none" or (backward is not None and c.backward != backward):
            continue
        out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0) + c.payload * c.count
    return out


def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one device sends for a ring implementation of this collective."""
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return payload * (factor if kind != "collective-permute" else 1.0)
