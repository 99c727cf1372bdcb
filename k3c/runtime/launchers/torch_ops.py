"""The launcher of the "library" and "view" backends: one op per launch, carried out by torch.

Library ops (GEMMs, einsum, embedding, ...) write their result into the planned buffer (directly where torch has an
`out=` form: `library.INTO_OPS`, else through a copy); view ops bind a view of
their input where they alias it (reshape, slice, ...) and copy only when the plan gave the value its own buffer;
`cache_append` writes the new rows into the pool in place (`bind_caches`): at the frame's L, or at the device
positions of a frame with device lengths (`k3c.runtime.frame`).
"""

from __future__ import annotations

import torch

from k3c.runtime.dims import evaluate
from k3c.runtime.launchers import Launcher
from k3c.runtime.library import ALIASING, INTO_OPS, run_op, run_op_into


class TorchOpLauncher(Launcher):
    def launch(self, frame, ln: dict) -> None:
        env = frame.env
        ins = [env[n] for n in ln["inputs"]]
        if ln["kind"] == "cache_append":
            B, L, T = frame.B, frame.L, frame.T
            pool = frame.session.pools[ln["inputs"][0]][:B]
            if frame.positions is None:
                pool[:, L:L + T].copy_(ins[1])
                env[ln["outputs"][0]] = pool[:, :L + T]
            else:  # device lengths: row b at positions lengths[b] + t; readers see the whole pool
                dst, rows = pool, ins[1]
                if pool.dtype == torch.float8_e4m3fn:   # index_put_ has no fp8 kernel on every device: the bytes
                    dst, rows = pool.view(torch.uint8), rows.view(torch.uint8)
                dst.index_put_((frame.rows, frame.positions), rows)
                env[ln["outputs"][0]] = pool
            return
        dims = ln["dim_attrs"]
        attrs = {k: (v if k not in dims else [evaluate(x, frame.sizes) for x in v] if isinstance(v, list)
                     else evaluate(v, frame.sizes)) for k, v in ln["attrs"].items()}
        outs = ln["outputs"]
        if ln["kind"] in INTO_OPS and len(outs) == 1 and outs[0] in frame.offsets:
            dst = frame.out(outs[0])
            if run_op_into(ln["kind"], attrs, ins, dst):
                env[outs[0]] = dst
                return
        for n, r in zip(outs, run_op(ln["kind"], attrs, ins)):
            dst = frame.out(n)
            if dst is not None and not (ln["kind"] in ALIASING and n not in frame.offsets):
                dst.copy_(r)
                env[n] = dst
            else:
                env[n] = r
