"""What the tensor-parallel test (test_tensor_parallel.py) runs in each spawned rank, the run it compares them with,
and the job that compiles and runs one world (conftest.py `tp_world`). A module of its own so that a rank imports
the runtime alone (torch, k3c.runtime), not the compiler that the test module imports: the six rank processes
start faster (`compile_and_run` imports the compiler when called)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import k3c
from k3c.runtime.launchers.collective import run_collective
from runtime_sizes import MAX_PREFILL, PROMPT, TP_STEPS

BATCHES = (1, 3)
#: collective -> (attrs, this rank's input shape): the launcher's cases, compared with the simulated collectives
CASES = {"all_reduce": ({}, (3, 5)), "all_gather": ({"dim": -1}, (3, 2)), "reduce_scatter": ({"dim": 1}, (3, 4)),
         "reduce_scatter_tokens": ({}, (1, 3, 4)), "shard_tokens": ({}, (3, 1, 4)),
         "all_gather_tokens": ({"shape": [3, 4]}, (1, 2, 4))}


def collective_inputs(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s f32 input of every case in a world of `world` ranks."""
    gen = torch.Generator().manual_seed(100 * world + rank)
    return {op: torch.randn(shape, generator=gen) for op, (_, shape) in CASES.items()}


def tokens(batch: int, vocab: int) -> torch.Tensor:
    """int64 [batch, PROMPT + TP_STEPS]: the prompt, then the token fed to each decode step (fixed rather than
    greedy, so that a near tie between two logits cannot send the runs being compared down different paths)."""
    return torch.randint(0, vocab, (batch, PROMPT + TP_STEPS), generator=torch.Generator().manual_seed(batch))


def logits(session, batch: int) -> torch.Tensor:
    """f32 [batch, 1 + TP_STEPS, vocab] of `session` (reset first): the prompt's last position (prefilled in calls of
    MAX_PREFILL tokens, as the multi-rank artifacts, compiled with that max_prefill, split it), then each decode
    step's."""
    session.reset()
    ids = tokens(batch, session.vocab)
    for chunk in ids[:, :PROMPT].split(MAX_PREFILL, 1):
        last = session.prefill(chunk)
    return torch.cat([last] + [session.decode(ids[:, t:t + 1]) for t in range(PROMPT, PROMPT + TP_STEPS)], 1)


def rank_main(rank: int, world: int, arts: dict[str, str], out: str) -> None:
    """One spawned rank (`k3c.runtime.distributed.spawn`): every artifact of its world (preset -> dir) at each batch,
    then the collectives of CASES; saves {"sessions": preset -> ((rank, tp), launchers), "logits": (preset, batch)
    -> logits, "collectives": op -> result} to `out`/rank{rank}.pt."""
    result: dict = {"sessions": {}, "logits": {}}
    for preset, art in arts.items():
        session = k3c.load(art)  # the first load joins the process group from torchrun's environment
        result["sessions"][preset] = (session.world, sorted(session.launchers))
        result["logits"].update({(preset, b): logits(session, b) for b in BATCHES})
    assert dist.get_world_size() == world
    xs = collective_inputs(rank, world)
    result["collectives"] = {op: run_collective(op, {"group": world, **a}, xs[op], rank)
                             for op, (a, _) in CASES.items()}
    torch.save(result, f"{out}/rank{rank}.pt")


def compile_and_run(world: int, options: dict, out: str) -> dict[str, dict]:
    """Compile each preset's `options[preset]` (CompileOptions with tp = `world`), then run them all in a spawned
    gloo world of `world` ranks (`rank_main`, saving to `out`). Returns {preset: compile summary}; a failed rank
    raises RuntimeError with its traceback (torch's own exception does not cross a process pool)."""
    from k3c.compile import compile_model
    from k3c.runtime.distributed import spawn

    summaries = {preset: compile_model(opts) for preset, opts in options.items()}
    try:
        spawn(rank_main, world, (world, {preset: str(opts.out) for preset, opts in options.items()}, out))
    except Exception as e:  # noqa: BLE001 - re-raised as one picklable exception
        raise RuntimeError(f"tensor-parallel world of {world} ranks: {type(e).__name__}: {e}") from None
    return summaries
