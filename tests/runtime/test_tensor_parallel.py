"""Multi-rank artifacts on CPU through the real runtime (issue 10's acceptance): every tiny preset compiled for
`cpu-x86-64` (TVM kernels) at TP = 2 and TP = 4 and run by spawned gloo processes (`k3c.runtime.distributed.spawn`,
what `k3c run` does: torchrun's environment, `k3c.load` joins the group) gives the TP = 1 artifact's logits
(fp32, max relative ≤ 1e-5) over a prefill and TP_STEPS decode steps at batch 1 and 3. The MXFP4 preset runs
expert-parallel (its experts partitioned, `--ep` = `--tp`), the dense ones split their experts' width (`--ep 1`).
Also: the collective launcher on gloo agrees with the simulated collectives at group sizes 2 and 4; a wrong world
size, a missing rank file and a `--tp` / `--ep` that does not split the model are one-line errors, and a refused
compile writes nothing.

Cost: one world of 2 and one of 4 processes per session, each rank loading its world's three artifacts; the TP = 1
artifacts and checkpoints are the TVM end-to-end test's (conftest.py `tvm_compiled`), fed the same prefill calls.
Each world's compiles and run are one job of the runtime tests' compiler pool (conftest.py `tp_world`), queued
before the first runtime test, so on CI's two cores they run beside the interpreted end-to-end tests.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import k3c
from k3c.compile import CompileOptions, compile_model
from k3c.errors import ArtifactError, ConfigError, RuntimeInputError
from k3c.ir.ops.collective import simulate_collective
from models.config import TINY_PRESETS
from runtime_sizes import MXFP4_PRESET, TP_STEPS, TP_WORLDS, tp_ep
from tp_ranks import BATCHES, CASES, collective_inputs, logits

pytestmark = pytest.mark.slow  # compiles six artifacts and spawns six processes: `make test`, not `make test-quick`
TARGET = "cpu-x86-64"
WORLDS = TP_WORLDS


@pytest.fixture(scope="module")
def worlds(tp_world) -> dict[int, tuple[dict, list[dict]]]:
    """world -> ({preset: (artifact dir, compile summary)}, what each rank saved (`tp_ranks.rank_main`)), compiled
    from the TVM end-to-end test's checkpoints (conftest.py `tp_world`)."""
    return {world: tp_world(world) for world in WORLDS}


@pytest.fixture(scope="module")
def tp_artifacts(worlds) -> dict[int, dict[str, tuple]]:
    """world -> preset -> (artifact dir, compile summary)."""
    return {world: arts for world, (arts, _) in worlds.items()}


@pytest.fixture(scope="module")
def ranks(worlds) -> dict[int, list[dict]]:
    """world -> what each of its ranks saved."""
    return {world: saved for world, (_, saved) in worlds.items()}


@pytest.fixture(scope="module")
def tp1_logits(tvm_compiled) -> dict[tuple[str, int], torch.Tensor]:
    """(preset, batch) -> the TP = 1 artifact's logits, run in this process on one torch thread, like each rank
    (these GEMMs are too small to gain from a second thread, and on a busy machine its waits cost 10x)."""
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for preset in TINY_PRESETS:
            session = k3c.load(tvm_compiled(preset)[2]("f32"))
            out.update({(preset, b): logits(session, b) for b in BATCHES})
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_collective_launcher_on_gloo_matches_the_simulation(ranks, world):
    for op, (attrs, _) in CASES.items():
        want = simulate_collective(op, {"group": world, **attrs}, [collective_inputs(r, world)[op]
                                                                  for r in range(world)])
        for r in range(world):
            torch.testing.assert_close(ranks[world][r]["collectives"][op], want[r], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_ranks_give_the_tp1_logits(tp_artifacts, ranks, tp1_logits, world, preset):
    art, summary = tp_artifacts[world][preset]
    assert sorted(p.name for p in (art / "weights").iterdir()) == [f"rank{r}.safetensors" for r in range(world)]
    assert summary["communication"]["bytes"] > 0
    for r, got in enumerate(ranks[world]):
        assert got["sessions"][preset] == ((r, world), ["collective", "library", "tvm", "view"])
    for b in BATCHES:
        got = [rk["logits"][preset, b] for rk in ranks[world]]
        assert all(torch.equal(g, got[0]) for g in got[1:])  # every rank ends with the whole logits
        want = tp1_logits[preset, b]
        assert got[0].shape == want.shape == (b, 1 + TP_STEPS, want.shape[-1])
        rel = float((got[0] - want).abs().max() / want.abs().max())
        print(f"{preset} TP={world} ep={tp_ep(preset, world)} batch {b}: max relative {rel:.2e} vs TP=1")
        assert rel <= 1e-5


def test_wrong_world_size_and_missing_rank_file(tp_artifacts, tmp_path):
    import torch.distributed as dist

    art = tp_artifacts[2][TINY_PRESETS[0]][0]
    with pytest.raises(RuntimeInputError, match="torchrun --nproc-per-node 2"):
        k3c.load(art)  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeInputError, match=r"compiled for tp = 2 ranks \(manifest.json tp\) .* world size 1"):
            k3c.load(art)
    finally:
        dist.destroy_process_group()
    broken = tmp_path / "broken"
    shutil.copytree(art, broken)
    (broken / "weights" / "rank1.safetensors").unlink()
    with pytest.raises(ArtifactError, match="rank1.safetensors"):
        k3c.load(broken)


@pytest.mark.parametrize("tp,ep,preset,message", [
    (3, 1, "kimi-linear-tiny", "--tp 3 does not divide num_attention_heads = 4"),
    (4, 2, "kimi-linear-tiny", "--ep 2: expected 1 .* or --tp"),
    (2, 1, MXFP4_PRESET, r"--tp 2 does not divide moe_intermediate_size / 32 .* = 1"),
])
def test_a_layout_that_does_not_split_is_refused_before_writing(tvm_compiled, tmp_path, tp, ep, preset, message):
    out = tmp_path / "art"
    with pytest.raises(ConfigError, match=message):
        compile_model(CompileOptions(str(tvm_compiled(preset)[1]), out, target=TARGET, tp=tp, ep=ep, dtype="f32"))
    assert not out.exists()


def test_k3c_run_spawns_the_ranks(tp_artifacts, tvm_compiled):
    """`k3c run` on a TP = 2 artifact starts its two ranks itself and prints the TP = 1 artifact's greedy tokens."""
    import contextlib
    import io
    import sys
    from unittest import mock

    from k3c.cli import main

    preset, ids, steps = "kimi-linear-tiny", [5, 7, 11], 4
    session = k3c.load(tvm_compiled(preset)[2]("f32"))
    want = [int(session.prefill(torch.tensor([ids]))[0, -1].argmax())]
    for _ in range(steps - 1):
        want.append(int(session.decode(torch.tensor([want[-1:]]))[0, -1].argmax()))
    stdout = io.StringIO()
    argv = ["k3c", "run", str(tp_artifacts[2][preset][0]), "--tokens", ",".join(map(str, ids)),
            "--decode-steps", str(steps)]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()), \
            mock.patch.object(sys, "argv", argv):
        main()  # returns on success (a failure exits)
    assert f"next tokens: {want}" in stdout.getvalue()
