"""One call's bindings of an artifact's schedule: values by name over weights, cache pools and the arena.

A `Frame` is made per prefill / decode call at its sizes {B, T, L}; `launch` runs one entry of `schedule.json`
through the launcher of its backend (`k3c.runtime.launchers`), which binds its outputs. Intermediates are
views of the session's arena at `plan.json`'s offsets; caches are views of the pools. Used by
`k3c.runtime.session` (eager execution) and `k3c.runtime.graphs` (capture).

A frame with device lengths (`lengths`: the session's i32 [B] context per row, in device memory; whole-step decode,
`k3c.runtime.graphs`) is built at the bound L = max_seq − T: the KV / index-key pools are bound whole, the kernels
that depend on the context read it from `sizes["lengths"]` and cache appends write row b at positions
lengths[b] + t, so no launch depends on a host-side length.
"""

from __future__ import annotations

import math

import torch

from k3c.runtime.dims import shape
from k3c.runtime.library import DTYPES


class Frame:
    """One call's bindings: every value of the schedule by name (weights, pool views, arena views at the plan's
    offsets) at sizes {B, T, L}, and `launch` to run one launch of the schedule on them."""

    def __init__(self, session, entry: str, B: int, T: int, L: int, lengths: torch.Tensor | None = None):
        self.session, self.entry, self.B, self.T, self.L = session, entry, B, T, L
        self.sizes = {"B": B, "T": T, "L": L}
        self.lengths = self.positions = None
        if lengths is not None:  # device lengths (module docstring): L is the bound
            self.sizes["lengths"] = self.lengths = lengths
            n = max(B, T)
            ar = session.aranges.get(n)
            if ar is None:  # made once per size by an eager step, so a captured graph launches no arange
                ar = session.aranges[n] = torch.arange(n, dtype=torch.int64, device=lengths.device)
            pos = lengths.long()[:, None]
            self.rows, self.positions = ar[:B, None], (pos if T == 1 else pos + ar[None, :T])  # [B,1], [B,T]
        sched = session.schedule[entry]
        self.types, self.offsets = sched["values"], session.offsets[entry]
        self.pool_of = {v: k for k, v in sched["outputs"].items() if k in session.pools}
        self.env: dict[str, torch.Tensor] = dict(session.weights)
        for name in sched["inputs"]:
            if name != "tokens":
                self.env[name] = self.pool_view(name, L)

    def pool_view(self, pool: str, length: int) -> torch.Tensor:
        """Pool `pool` for the frame's batch: KV / index-key pools cut to `length` tokens, states whole."""
        p = self.session.pools[pool][:self.B]
        return p[:, :length] if pool.endswith((".kv", ".index_k", ".index_k_scale", ".index_k_lo")) else p

    def out(self, name: str) -> torch.Tensor | None:
        """The buffer value `name` is written to (a pool or the arena at its planned offset), or None (not planned)."""
        if name in self.pool_of:
            return self.pool_view(self.pool_of[name], self.L + self.T)
        if name in self.offsets:
            t = self.types[name]
            shp = shape(t["shape"], self.sizes)
            dt = DTYPES[t["dtype"]]
            off = self.offsets[name]
            return self.session.arena[off:off + math.prod(shp) * dt.itemsize].view(dt).view(shp)
        return None

    def launch(self, ln: dict) -> None:
        """Run launch `ln` of the schedule through its backend's launcher, binding its outputs in `env`."""
        self.session.launchers[ln["backend"]].launch(self, ln)
