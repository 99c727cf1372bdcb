"""`guard_scratch(session, monkeypatch)`: make every launch with planned scratch (schedule.json "scratch",
`k3c.passes.plan_memory`) prove it runs on the arena's buffers: each generated kernel module's `take_scratch` is
wrapped so that a launch that would allocate its scratch fails and each buffer handed over must lie inside the
session's arena. Returns a Counter of the buffers handed over per launch kind, for the caller to check that the
guarded paths ran (used by test_end_to_end.py on the prefills it already runs: no extra interpreted work)."""

from __future__ import annotations

from collections import Counter


def guard_scratch(session, monkeypatch) -> Counter:
    lo = session.arena.data_ptr()
    hi = lo + session.arena.numel()
    handed: Counter = Counter()
    kinds = {ln["name"]: ln["kind"] for e in session.schedule.values() for ln in e["launches"]}
    triton = session.launchers.get("triton")
    for name, mod in (triton.kernels.items() if triton is not None else ()):
        if not hasattr(mod, "take_scratch"):
            continue

        def guarded(scratch, key, shape, dtype, device, _take=mod.take_scratch, _name=name):
            assert scratch is not None, f"{_name} allocates its scratch {key!r}: no planned buffer was handed over"
            t = _take(scratch, key, shape, dtype, device)
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi, (_name, key)
            handed[kinds[_name]] += 1
            return t

        monkeypatch.setattr(mod, "take_scratch", guarded)
    return handed
