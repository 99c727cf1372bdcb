"""The launcher of the "collective" backend: the IR's collectives on torch.distributed (NCCL on GPUs, gloo on CPUs).

Each rank runs the same schedule; the process group is the default one, initialised by `torchrun` or by `k3c run`
(which spawns the ranks of a multi-rank artifact itself), and `k3c.runtime.session` checks that its world size is
the artifact's `tp`. The mapping (semantics: `k3c/ir/ops/collective.py`; the runtime keeps its own copy so that it
never imports the compiler):

    all_reduce                  dist.all_reduce (sum), in place in the planned buffer
    all_gather {dim}            all_gather_single (all_gather_into_tensor before torch 2.13) along dim 0, then the
                                rank blocks concatenated along `dim`
    reduce_scatter {dim}        reduce_scatter_single (reduce_scatter_tensor before 2.13) of x moved to dim 0
    reduce_scatter_tokens       rows flattened and zero-padded to g·ceil(N/g), then reduce_scatter -> [1, n, D]
    all_gather_tokens {shape}   all_gather of the [n, D] shards, padding dropped, reshaped
    shard_tokens                this rank's padded rows; no communication

The calls are plain stream-ordered collectives with static sizes, so decode CUDA graphs capture them (NCCL
supports capture). At tp = 1 they reduce to copies and need no process group.
"""

from __future__ import annotations

import torch

from k3c.errors import RuntimeInputError
from k3c.runtime.dims import evaluate
from k3c.runtime.launchers import Launcher

COLLECTIVE_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "reduce_scatter_tokens",
                            "all_gather_tokens", "shard_tokens"})


def _dist():
    import torch.distributed as dist

    return dist


def _gather0(x: torch.Tensor, g: int) -> torch.Tensor:
    """cat over ranks along dim 0."""
    dist = _dist()
    out = torch.empty((g * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 : 2.11
    gather(out, x.contiguous())
    return out


def _scatter0(x: torch.Tensor, g: int) -> torch.Tensor:
    """sum over ranks, this rank's block of dim 0."""
    dist = _dist()
    out = torch.empty((x.shape[0] // g,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x.contiguous())
    return out


def _padded_rows(x: torch.Tensor, g: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    n = -(-rows.shape[0] // g)
    padded = torch.zeros((n * g, rows.shape[1]), dtype=x.dtype, device=x.device)
    padded[:rows.shape[0]] = rows
    return padded


def run_collective(op: str, attrs: dict, x: torch.Tensor, rank: int) -> torch.Tensor:
    """Collective `op` of this rank's `x` (attrs with dims evaluated); see the module docstring."""
    g = attrs["group"]
    if g == 1:
        if op in ("reduce_scatter_tokens", "shard_tokens"):
            return x.reshape(1, -1, x.shape[-1])
        if op == "all_gather_tokens":
            return x.reshape(attrs["shape"])
        return x
    if op == "all_reduce":
        y = x.clone()
        _dist().all_reduce(y)
        return y
    if op == "all_gather":
        d = attrs["dim"] % x.dim()
        return torch.cat(_gather0(x, g).chunk(g, 0), d) if d else _gather0(x, g)
    if op == "reduce_scatter":
        d = attrs["dim"] % x.dim()
        return _scatter0(x.movedim(d, 0), g).movedim(0, d).contiguous()
    if op == "reduce_scatter_tokens":
        return _scatter0(_padded_rows(x, g), g).unsqueeze(0)
    if op == "shard_tokens":
        return _padded_rows(x, g).chunk(g, 0)[rank].unsqueeze(0)
    if op == "all_gather_tokens":
        shape = attrs["shape"]
        n = 1
        for d in shape[:-1]:
            n *= d
        return _gather0(x[0], g)[:n].reshape(shape)
    raise RuntimeInputError(f"unknown collective {op!r}")


class CollectiveLauncher(Launcher):
    def __init__(self, art, device, launches: list[dict], workdir):
        super().__init__(art, device, launches, workdir)
        dist = _dist()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def launch(self, frame, ln: dict) -> None:
        dims = ln["dim_attrs"]
        attrs = {k: (v if k not in dims else [evaluate(x, frame.sizes) for x in v] if isinstance(v, list)
                     else evaluate(v, frame.sizes)) for k, v in ln["attrs"].items()}
        y = run_collective(ln["kind"], attrs, frame.env[ln["inputs"][0]], self.rank)
        name = ln["outputs"][0]
        dst = frame.out(name)
        if dst is not None:
            dst.copy_(y)
            y = dst
        frame.env[name] = y
