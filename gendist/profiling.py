"""Where the time goes: device time of a compiled step split by kind of op.

The lecture's question (Ivanov et al. 2021, "Data Movement Is All You Need": matmuls are
99.8% of a BERT layer's FLOPs but 61% of its runtime) asked of our own step. Two pieces:

- `classify_hlo(text)`: every instruction of the compiled HLO module that launches work,
  mapped to a kind: matmul (also one-row dots that XLA writes as a reduce of a product),
  attention, normalisation (other fusions with a reduction),
  elementwise, data movement (copies, transposes, slices, casts-only fusions), collective.
- `time_by_kind(profile_data, kinds)`: device events of a profiler trace (each GPU
  kernel carries the `hlo_op` that launched it) summed per kind.
- `trace(trace_dir=None)`: `jax.profiler.trace` that hands back the profile on every jax
  this project supports (0.11 yields no session; the exported trace is read back instead).

    kinds = classify_hlo(step.lower(*args).compile().as_text())
    with trace() as prof:
        run_steps()
    split = time_by_kind(prof.profile_data, kinds)
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax

KINDS = ("matmul", "attention", "normalisation", "elementwise", "data movement",
         "collective", "other")

_MOVE = {"copy", "transpose", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate",
         "pad", "gather", "scatter", "reshape", "bitcast", "broadcast", "copy-start",
         "copy-done", "reverse", "iota", "convert"}
_STRUCT = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "broadcast",
           "reshape"}
_NO_KERNEL = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
              "partition-id", "replica-id", "opt-barrier", "add-dependency"}
_CONTROL = {"while", "conditional", "call"}  # their events span the ops they run: skipped
_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast|send|recv)")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"[\]\}\)]\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_MATMUL_NAME = re.compile(r"gemm|cublas|matmul|matvec|nvjet|cutlass|xmma|wgmma", re.I)
_ATTN_NAME = re.compile(r"fmha|sdpa|flash|attention|attn", re.I)


def parse_hlo(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """{computation: [(instruction name, opcode, line)]} of an HLO module's text."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            current = h.group(1)
            comps[current] = []
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            op = _OPCODE.search(m.group(2))
            comps[current].append((m.group(1), op.group(1) if op else "", line))
    return comps


def entry_computation(text: str) -> str | None:
    """The name of an HLO module's ENTRY computation, None if the text has none."""
    return next((m.group(1) for line in text.splitlines()
                 if line.startswith("ENTRY") and (m := _HEADER.match(line))), None)


def _custom_call_kind(line: str) -> str:
    target = _TARGET.search(line)
    tgt = target.group(1) if target else ""
    head = line.split("metadata=")[0]  # op_name metadata names the Python caller, not the op
    if _ATTN_NAME.search(tgt) or ("triton" in tgt and _ATTN_NAME.search(head)):
        return "attention"
    if _MATMUL_NAME.search(tgt) or ("triton" in tgt and _MATMUL_NAME.search(head)):
        return "matmul"
    if tgt.startswith("mosaic_gpu"):  # a Pallas Mosaic GPU kernel: named only by its caller
        op_name = re.search(r'op_name="([^"]*)"', line)
        caller = op_name.group(1) if op_name else ""
        if _ATTN_NAME.search(caller):
            return "attention"
        if _MATMUL_NAME.search(caller):
            return "matmul"
    return "other"


_PASS_THROUGH = {"convert", "bitcast", "broadcast", "reshape", "copy", "transpose"}
_SHAPE = re.compile(r"=\s*\w+\[([\d,]*)\]")


def _operands(line: str, op: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", line.split(f" {op}(", 1)[1].split(")", 1)[0])


def _is_matrix_vector(ops: list[tuple[str, str, str]], comps) -> bool:
    """A reduce-sum of a product of two different inputs, one of them a matrix: the form XLA
    gives a dot with one row (a decode step's matmuls), which the GPU runs as a reduction
    fusion. A norm's sum of squares multiplies one input by itself and does not count."""
    by_name = {name: (op, line) for name, op, line in ops}

    def source(name):
        while name in by_name and by_name[name][0] in _PASS_THROUGH:
            name = _operands(by_name[name][1], by_name[name][0])[0]
        return name

    def is_matrix(name):
        op, line = by_name.get(name, ("", ""))
        shape = _SHAPE.search(line)
        dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
        return op == "parameter" and sum(d > 1 for d in dims) >= 2

    for _, op, line in ops:
        if op != "reduce":
            continue
        adder = re.search(r"to_apply=%([\w.\-]+)", line)
        if not adder or "add" not in {o for _, o, _ in comps.get(adder.group(1), [])}:
            continue
        prod = source(_operands(line, op)[0])
        if by_name.get(prod, ("",))[0] != "multiply":
            continue
        a, b = (source(x) for x in _operands(by_name[prod][1], "multiply"))
        if a != b and (is_matrix(a) or is_matrix(b)):
            return True
    return False


def _fusion_kind(ops: list[tuple[str, str, str]], comps) -> str:
    opcodes = {op for _, op, _ in ops}
    for _, op, line in ops:
        if op == "custom-call" and _custom_call_kind(line) != "other":
            return _custom_call_kind(line)
        if op == "fusion":  # nested fusion (e.g. a cuDNN or Triton GEMM fusion)
            sub = _CALLS.search(line)
            if sub and sub.group(1) in comps:
                k = _fusion_kind(comps[sub.group(1)], comps)
                if k in ("matmul", "attention"):
                    return k
    if opcodes & {"dot", "convolution", "ragged-dot", "scaled-dot"}:
        return "matmul"
    if "reduce" in opcodes and _is_matrix_vector(ops, comps):
        return "matmul"
    if opcodes & {"reduce", "reduce-window"}:
        return "normalisation"
    if opcodes <= (_MOVE | _STRUCT):
        return "data movement"
    return "elementwise"


def classify_hlo(text: str) -> dict[str, str]:
    """{instruction name: kind} for every kernel-launching instruction of a compiled module."""
    comps = parse_hlo(text)
    # Computations that run inside one kernel: fusion bodies, async wrappers and the scalar
    # functions of reduce/sort/scatter/all-reduce. A `call`'s body launches its own kernels.
    fused = set()
    for ops in comps.values():
        for _, op, line in ops:
            if op == "fusion" or op.endswith("-start"):
                fused.update(_CALLS.findall(line))
            if op != "call":
                fused.update(re.findall(r"to_apply=%([\w.\-]+)", line))
    kinds = {}
    for comp, ops in comps.items():
        if comp in fused:
            continue
        for name, op, line in ops:
            if op in _NO_KERNEL or not op:
                continue
            if op in _CONTROL:
                kinds[name] = "control"
            elif _COLLECTIVE.match(op):
                kinds[name] = "collective"
            elif op == "fusion":
                sub = _CALLS.search(line)
                inner = comps.get(sub.group(1), []) if sub else []
                kinds[name] = _fusion_kind(inner, comps)
            elif op == "custom-call":
                kinds[name] = _custom_call_kind(line)
            elif op in ("dot", "convolution"):
                kinds[name] = "matmul"
            elif op in ("reduce", "reduce-window"):
                kinds[name] = "normalisation"
            elif op in _MOVE:
                kinds[name] = "data movement"
            else:
                kinds[name] = "elementwise"
    return kinds


def loop_body_kinds(text: str) -> dict[str, int]:
    """Kernel-launching instructions per kind in a decode loop's step, read from a compiled
    module's HLO: the body of the last loop the entry computation runs (a generate's prompt
    may be a loop over its layers before it), or of a loop nested in that one if it launches
    more: how many kernels one step starts, before any profile. {} when the module has no
    loop."""
    comps = parse_hlo(text)
    kinds = classify_hlo(text)
    entry = entry_computation(text)

    def loops(comp: str) -> list[str]:
        return [body for _, op, line in comps.get(comp, ()) if op == "while"
                for body in re.findall(r"body=%([\w.\-]+)", line)]

    top = loops(entry) if entry else []
    bodies, todo = [], top[-1:]
    while todo:
        body = todo.pop()
        if body not in bodies:
            bodies.append(body)
            todo.extend(loops(body))
    best: dict[str, int] = {}
    for body in bodies:
        count = collections.Counter(kinds[name] for name, _, _ in comps.get(body, ())
                                    if name in kinds)
        if sum(count.values()) > sum(best.values()):
            best = dict(count)
    return best


def load_profile(session, trace_dir: str):
    """The ProfileData of a finished `jax.profiler.trace(trace_dir)`.

    Newer jax hands it over on the session object; older releases (0.11) yield nothing
    from the context manager, so the exported `*.xplane.pb` is read back instead.
    """
    data = getattr(session, "profile_data", None)
    if data is not None:
        return data
    files = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: was the trace exported?")
    try:
        from jax.profiler import ProfileData
    except ImportError:  # jax 0.11 keeps it in jaxlib
        from jax._src.lib import _profile_data
        ProfileData = _profile_data.ProfileData
    return ProfileData.from_file(str(files[-1]))


class Trace:
    """What `trace()` yields: `profile_data` is set when the `with` block exits."""

    def __init__(self, trace_dir: str | None):
        self.trace_dir = trace_dir  # where the xplane trace was exported (None: not kept)
        self.profile_data = None


@contextlib.contextmanager
def trace(trace_dir: str | None = None) -> Iterator[Trace]:
    """Profile the block; afterwards `.profile_data` holds the ProfileData on jax 0.11 and 0.12.

    With `trace_dir` the trace is also kept there (for xprof / TensorBoard); without one it
    is exported to a temporary directory (jax 0.11 needs a file to read back) and removed.
    """
    out = Trace(trace_dir)
    target = trace_dir or tempfile.mkdtemp(prefix="gendist_trace_")
    try:
        with jax.profiler.trace(target) as session:
            yield out
        out.profile_data = load_profile(session, target)
    finally:
        if trace_dir is None:
            shutil.rmtree(target, ignore_errors=True)


_MOVE_WORDS = {"copy", "transpose", "dynamic", "update", "slice", "concatenate", "pad",
               "gather", "scatter", "reshape", "bitcast", "broadcast", "convert", "reverse",
               "iota"}


def _sanitize(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def _kernel_kind(name: str) -> str:
    """A kernel's kind from its name alone (XLA names a fusion's kernel after the fusion)."""
    if _ATTN_NAME.search(name):
        return "attention"
    if _MATMUL_NAME.search(name):
        return "matmul"
    if re.search(r"memcpy|memset", name, re.I):
        return "data movement"
    words = set(re.findall(r"[a-z]+", name.lower())) - {"loop", "input", "fusion", "wrapped",
                                                         "kernel", "bitcast"}
    if "reduce" in words:
        return "normalisation"
    if "fusion" in name or name.startswith("wrapped"):
        return "data movement" if words and words <= _MOVE_WORDS else "elementwise"
    return "other"


def device_events(profile_data):
    """(event name, hlo_op or None, duration in seconds) of every device-side op event.

    GPU: kernels on the `/device:GPU:*` planes' stream lines. CPU (tests): the XLA
    executor threads' events, which carry `hlo_op` too.
    """
    out = []
    for plane in profile_data.planes:
        gpu = plane.name.startswith("/device:GPU")
        if not (gpu or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            if gpu and not line.name.startswith("Stream"):
                continue  # "XLA Ops"/"XLA Modules" lines repeat the stream events
            if not gpu and not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                hlo = stats.get("hlo_op")
                if not gpu and hlo is None:
                    continue
                out.append((ev.name, hlo, ev.duration_ns * 1e-9))
    return out


def time_by_kind(profile_data, kinds: dict[str, str]) -> dict:
    """Seconds per kind, plus the top ops, from a profile's device events."""
    per_kind = collections.Counter()
    launches = collections.Counter()
    per_op = collections.Counter()
    op_kind = {}
    by_kernel_name = {_sanitize(n): k for n, k in kinds.items()}
    for name, hlo, dur in device_events(profile_data):
        kind = kinds.get(hlo) if hlo else None
        if kind == "control" and name == hlo:
            continue  # a loop's own span covers the ops it runs
        key = hlo or name
        if kind in (None, "control"):
            # Kernels replayed from a CUDA graph (XLA command buffer) carry the command
            # buffer as their hlo_op: fall back to the kernel's own name.
            key = name
            kind = kinds.get(name) or by_kernel_name.get(_sanitize(name)) or _kernel_kind(name)
        per_kind[kind] += dur
        launches[kind] += 1
        per_op[key] += dur
        op_kind[key] = kind
    total = sum(per_kind.values())
    return {"total_s": total,
            "seconds": {k: per_kind.get(k, 0.0) for k in KINDS},
            "fraction": {k: (per_kind.get(k, 0.0) / total if total else 0.0) for k in KINDS},
            "launches": {k: launches.get(k, 0) for k in KINDS},
            "top_ops": [{"op": op, "kind": op_kind[op], "s": s}
                        for op, s in per_op.most_common(40)]}
