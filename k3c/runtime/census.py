"""Launch census: the device launches one decode step makes, attributed to the launches of `schedule.json`.

A decode step replays one CUDA graph (`k3c.runtime.graphs`), so every kernel a launcher starts costs a launch gap
in it, glue included: a `torch.zeros` of a counter is a fill kernel, a `.contiguous()` a copy. The census runs one
step the way the graph capture does (a frame with device lengths, every launch of the entry, the lengths
increment) and counts, per schedule launch:
- the Triton kernels it starts (`kernel[grid](...)`, compiled or interpreted: `JITFunction.run` /
  `InterpretedFunction.run`), by kernel name;
- every ATen op its launcher calls that starts device work (through a `TorchDispatchMode`), by op name. Not
  counted: views (`OpOverload.is_view`) and allocations (`empty*`, `lift_fresh`), which start nothing. The torch
  ops Triton's interpreter makes while it runs a kernel are not the kernel's launches and are left out.

It runs on any device; on CPU the Triton kernels run in the interpreter (f32 artifacts), so the census of a tiny
artifact on a CPU counts what the same schedule launches on the GPU. Not seen: work a library call starts inside
one ATen op (cuBLAS's split-K reduction kernel, for one), and host-to-device copies made by `torch.tensor(...,
device=...)` on a CPU device.

    rows = census(session, tokens)          # tokens int64 [B, 1]; the session's contexts move on by one
    total = sum(r.total for r in rows)
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3c.runtime.frame import Frame

#: ATen ops that allocate or alias and start no device work
_NO_WORK = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                      "detach", "alias", "set_", "resize_", "_reshape_alias"})


@dataclass
class LaunchCount:
    """The device launches of one schedule launch `name` (`kind`, `backend`): Triton kernels and ATen ops by name."""

    name: str
    kind: str
    backend: str
    triton: Counter = field(default_factory=Counter)
    aten: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())


class _Counter(TorchDispatchMode):
    """Counts the work-starting ATen ops into `self.row` (None: not counting)."""

    def __init__(self):
        super().__init__()
        self.row: LaunchCount | None = None
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.row is not None and not self.inside_triton and not func.is_view and name not in _NO_WORK:
            self.row.aten[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _count_triton(mode: _Counter):
    """Patch the Triton launch entry points (compiled and interpreted) to count into `mode.row` while active."""
    from triton.runtime import interpreter, jit

    classes = [c for c in (jit.JITFunction, getattr(interpreter, "InterpretedFunction", None)) if c is not None]
    originals = {c: c.__dict__["run"] for c in classes}

    def wrap(orig):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup and mode.row is not None:
                mode.row.triton[getattr(self, "__name__", None) or self.fn.__name__] += 1
            mode.inside_triton += 1
            try:
                return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                mode.inside_triton -= 1
        return run

    for c, orig in originals.items():
        c.run = wrap(orig)
    try:
        yield
    finally:
        for c, orig in originals.items():
            c.run = orig


def census(session, tokens: torch.Tensor) -> list[LaunchCount]:
    """Run one decode step of `session` on `tokens` (int64 [B, 1], on the session's device) as the whole-step
    graph would (module docstring) and return one `LaunchCount` per launch of the decode schedule, in order, plus
    "(frame)" (the append positions computed from the device lengths) and "(lengths)" (their increment) rows.
    The step really runs: caches and lengths advance as after `session.decode`.
    Raises ValueError for a session without device lengths (an artifact whose decode needs host lengths)."""
    if session.lengths is None:
        raise ValueError("census: this artifact's decode takes the context length from the host (no device lengths)")
    B = tokens.shape[0]
    lengths = session.lengths[:B]
    sched = session.schedule["decode"]
    mode = _Counter()
    rows = [LaunchCount("(frame)", "frame", "torch")]
    with _count_triton(mode), mode:
        mode.row = rows[0]
        frame = Frame(session, "decode", B, 1, session.max_seq - 1, lengths)
        frame.env["tokens"] = tokens
        for ln in sched["launches"]:
            rows.append(LaunchCount(ln["name"], ln["kind"], ln["backend"]))
            mode.row = rows[-1]
            frame.launch(ln)
        rows.append(LaunchCount("(lengths)", "lengths", "torch"))
        mode.row = rows[-1]
        lengths.add_(1)
        mode.row = None
    session.batch = B
    session._length += 1
    return rows


def summary(rows: list[LaunchCount]) -> dict:
    """Totals of a census: launches per step, by Triton kernel, by ATen op, and the glue (ATen ops made by
    launches of the Triton backend, plus the frame and lengths rows)."""
    triton, aten, glue = Counter(), Counter(), Counter()
    for r in rows:
        triton.update(r.triton)
        aten.update(r.aten)
        if r.backend in ("triton", "torch"):
            glue.update({f"{r.kind}: {k}": v for k, v in r.aten.items()})
    return {"launches": sum(r.total for r in rows), "schedule_launches": len(rows) - 2,
            "triton": dict(sorted(triton.items())), "aten": dict(sorted(aten.items())),
            "glue": dict(sorted(glue.items()))}
