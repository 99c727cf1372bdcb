"""One call's bindings of an artifact's schedule: values by name over weights, cache pools and the arena.

A `Frame` is made per prefill / decode call at its sizes {B, T, L}; `launch` runs one entry of `schedule.json`
(a generated Triton kernel, a library op, a view or a cache append) and binds its outputs. Intermediates are
views of the session's arena at `plan.json`'s offsets; caches are views of the pools. Used by
`k3c.runtime.session` (eager execution) and `k3c.runtime.graphs` (capture). Raises ArtifactError for a kernel
output the plan has no buffer for, or an op this runtime does not implement.
"""

from __future__ import annotations

import math

import torch

from k3c.errors import ArtifactError
from k3c.runtime.dims import evaluate, shape
from k3c.runtime.launchers.tvm import launch as tvm_launch
from k3c.runtime.library import ALIASING, DTYPES, run_op


class Frame:
    """One call's bindings: every value of the schedule by name (weights, pool views, arena views at the plan's
    offsets) at sizes {B, T, L}, and `launch` to run one launch of the schedule on them."""

    def __init__(self, session, entry: str, B: int, T: int, L: int):
        self.session, self.entry, self.B, self.T, self.L = session, entry, B, T, L
        self.sizes = {"B": B, "T": T, "L": L}
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
        return p[:, :length] if pool.endswith((".kv", ".index_k")) else p

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
        """Run launch `ln` of the schedule, binding its outputs in `env`."""
        env, B, L, T = self.env, self.B, self.L, self.T
        ins = [env[n] for n in ln["inputs"]]
        if ln["backend"] in ("triton", "tvm"):
            outs = [self.out(n) for n in ln["outputs"]]
            for n, o in zip(ln["outputs"], outs):
                if o is None:
                    raise ArtifactError(f"kernel {ln['name']} output {n} has no buffer in plan.json")
            ins = [x.contiguous() for x in ins]
            if ln["backend"] == "tvm":
                tvm_launch(self.session.tvm_library.function(ln["symbol"]), ins, outs, self.sizes)
            else:
                self.session.kernels[ln["name"]].launch(ins, outs, self.sizes)
            env.update(zip(ln["outputs"], outs))
            return
        if ln["kind"] == "cache_append":
            pool = self.session.pools[ln["inputs"][0]][:B]
            pool[:, L:L + T].copy_(ins[1])
            env[ln["outputs"][0]] = pool[:, :L + T]
            return
        attrs = {k: (evaluate(v, self.sizes) if k in ln["dim_attrs"] and not isinstance(v, list)
                     else [evaluate(x, self.sizes) for x in v] if k in ln["dim_attrs"] else v)
                 for k, v in ln["attrs"].items()}
        for n, r in zip(ln["outputs"], run_op(ln["kind"], attrs, ins)):
            dst = self.out(n)
            if dst is not None and not (ln["kind"] in ALIASING and n not in self.offsets):
                dst.copy_(r)
                env[n] = dst
            else:
                env[n] = r
