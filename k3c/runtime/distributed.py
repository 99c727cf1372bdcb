"""The ranks of a multi-rank artifact: joining torch.distributed's process group, and starting the ranks on one
host as `torchrun --nproc-per-node N` does (for `k3c run` and the tests).

A tp = N artifact runs as N processes, one per rank (`k3c.runtime.session`): each is a member of the default process
group (NCCL on cuda, gloo on cpu) of world size N and loads `weights/rank{RANK}.safetensors`.

- `join(tp, device, where)`, called by `k3c.load`: the rank of this process. Under torchrun's environment
  (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) it initialises the default group when nobody has yet.
- `spawn(fn, world, args)`: start `world` processes on this host (torch.multiprocessing, start method "spawn"), each
  with torchrun's environment (MASTER_ADDR 127.0.0.1, a free MASTER_PORT, RANK = LOCAL_RANK = its rank,
  WORLD_SIZE) and its share of the cores (below), and call `fn(rank, *args)` in each (`fn` must be picklable: a
  module-level function). Returns when every rank has exited; a rank that failed raises torch.multiprocessing's
  ProcessRaisedException (its traceback) or ProcessExitedException (its exit code) here. Each rank leaves the
  group on return.

Cores: N CPU ranks on one host share its cores, but each rank's torch intra-op pool and the TVM kernels' pool
(`K3C_NUM_THREADS`, k3c/codegen/tvm/cpu_runtime.c) default to every core, so N ranks would run N × cores threads
and preempt each other at every collective. `spawn` gives each rank cores // N threads (at least one) unless
OMP_NUM_THREADS / K3C_NUM_THREADS are set (torchrun sets OMP_NUM_THREADS=1 for the same reason).
This module imports torch only (torch.distributed and torch.multiprocessing on use).
"""

from __future__ import annotations

import os
import socket

import torch

from k3c.errors import RuntimeInputError


def join(tp: int, device: torch.device, where) -> int:
    """This process's rank in the default process group of world size `tp`, initialising the group (NCCL on cuda,
    gloo on cpu) from torchrun's environment when it is set and nobody did yet. `where` (the artifact path) goes
    into the errors. Raises RuntimeInputError when there is no group or its world size is not `tp`."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeInputError(f"{where}: a tp = {tp} artifact runs as {tp} ranks: start it with `torchrun "
                                f"--nproc-per-node {tp}` or `k3c run` (torch.distributed is not initialised here)")
    world = dist.get_world_size()
    if world != tp:
        raise RuntimeInputError(f"{where}: compiled for tp = {tp} ranks (manifest.json tp) but the process group has "
                                f"world size {world}")
    return dist.get_rank()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, args: tuple = ()) -> None:
    """Run `fn(rank, *args)` in `world` processes with torchrun's environment; see the module docstring."""
    import torch.multiprocessing as mp

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    threads = max(1, len(os.sched_getaffinity(0)) // world)
    mp.spawn(_rank_main, args=(fn, env, threads, args), nprocs=world, join=True)


def _rank_main(rank: int, fn, env: dict, threads: int, args: tuple) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    for var in ("OMP_NUM_THREADS", "K3C_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        fn(rank, *args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
