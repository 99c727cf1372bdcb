"""Multi-rank artifacts on CPU: the collective launcher on gloo agrees with the simulated collectives; a TP=2
artifact run by two spawned gloo processes gives the eager model's logits; a wrong world size, a missing rank
file and a --tp that does not divide the model are one-line errors."""

from __future__ import annotations

import os
import shutil
import socket

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import k3c  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from k3c.errors import ArtifactError, ConfigError, RuntimeInputError  # noqa: E402
from k3c.ir.ops.collective import simulate_collective  # noqa: E402
from models.config import K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402

#: the compile target of these tests (a CPU target: its code generator decides how fast the ranks run)
TARGET = "cpu-x86-64"
PRESET, PROMPT, STEPS = "kimi-linear-tiny", 4, 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


CASES = {"all_reduce": ({}, (3, 5)), "all_gather": ({"dim": -1}, (3, 2)), "reduce_scatter": ({"dim": 1}, (3, 4)),
         "reduce_scatter_tokens": ({}, (1, 3, 4)), "shard_tokens": ({}, (3, 1, 4)),
         "all_gather_tokens": ({"shape": [3, 4]}, (1, 2, 4))}


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {op: torch.randn(shape, generator=gen) for op, (_, shape) in CASES.items()}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    model = save_random_checkpoint(K3Config.from_pretrained(PRESET), root / "ckpt", seed=3, dtype=torch.float32)
    opts = CompileOptions(str(root / "ckpt"), root / "art", target=TARGET, tp=2, ep=2, max_batch=1,
                          max_seq=PROMPT + STEPS, max_prefill=PROMPT, dtype="f32")
    summary = compile_model(opts)
    return root, model.eval(), summary


def _worker(rank, world, port, art, out):
    """One rank: the collectives of `CASES`, then the artifact's prefill + greedy decode (one spawn for both:
    starting a process costs more than either)."""
    from k3c.runtime.launchers.collective import run_collective

    _init(rank, world, port)
    xs = _inputs(rank)
    results = {op: run_collective(op, {"group": world, **a}, xs[op], rank) for op, (a, _) in CASES.items()}
    session = k3c.load(art)
    tokens = torch.arange(PROMPT).reshape(1, PROMPT) * 7 % session.vocab
    logits = [session.prefill(tokens)]
    for _ in range(STEPS):
        logits.append(session.decode(logits[-1][:, -1:].argmax(-1)))
    torch.save({"collectives": results, "logits": torch.cat(logits, 1)}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tp2, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(2, _port(), str(tp2[0] / "art"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_collective_launcher_on_gloo_matches_the_simulation(ranks):
    for op, (attrs, _) in CASES.items():
        want = simulate_collective(op, {"group": 2, **attrs}, [_inputs(r)[op] for r in range(2)])
        for r in range(2):
            torch.testing.assert_close(ranks[r]["collectives"][op], want[r], rtol=1e-6, atol=1e-6)


def test_two_gloo_ranks_give_the_eager_logits(tp2, ranks):
    root, model, summary = tp2
    assert sorted(p.name for p in (root / "art" / "weights").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    assert summary["communication"]["bytes"] > 0
    got = [r["logits"] for r in ranks]
    assert torch.equal(got[0], got[1])
    tokens = torch.arange(PROMPT).reshape(1, PROMPT) * 7 % model.config.vocab_size
    with torch.no_grad():
        want, cache = model(tokens)
        steps = [want[:, -1:]]  # prefill returns the last position's logits
        for _ in range(STEPS):
            want, cache = model(steps[-1][:, -1:].argmax(-1), cache)
            steps.append(want)
    want = torch.cat(steps, 1)
    assert float((got[0] - want).abs().max() / want.abs().max()) <= 1e-5


def test_wrong_world_size_and_missing_rank_file(tp2, tmp_path):
    import torch.distributed as dist

    root, _, _ = tp2
    art = root / "art"
    with pytest.raises(RuntimeInputError, match="torchrun --nproc-per-node 2"):
        k3c.load(art)  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeInputError, match="compiled for tp = 2 ranks .* world size 1"):
            k3c.load(art)
    finally:
        dist.destroy_process_group()
    broken = tmp_path / "broken"
    shutil.copytree(art, broken)
    (broken / "weights" / "rank1.safetensors").unlink()
    with pytest.raises(ArtifactError, match="rank1.safetensors"):
        k3c.load(broken)


def test_tp_that_does_not_divide_is_refused_before_writing(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(ConfigError, match="--tp 3 does not divide num_attention_heads = 4"):
        compile_model(CompileOptions(PRESET, out, target=TARGET, tp=3, plan_only=True, dtype="f32"))
    assert not out.exists()
