"""`moe_schedule` (k3c.codegen.triton.moe): the expert tile schedule, from `moe_schedule_kernel` (few rows) and from
the torch path (many rows), against a plain-Python construction: rows stably sorted by expert (unused slots last),
cut into tiles of BLOCK_M rows of one expert, tiles past the schedule marked with expert E."""

from __future__ import annotations

import os

import pytest
import torch

#: on a GPU the kernel runs natively; on CPU under Triton's interpreter (set before triton.jit runs)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3c.codegen.triton import moe  # noqa: E402


def reference(ids: torch.Tensor, E: int, BLOCK_M: int):
    flat = [int(i) for i in ids.reshape(-1)]
    rows = len(flat)
    order = sorted(range(rows), key=lambda r: flat[r] if flat[r] >= 0 else E)  # sorted() is stable
    n_tiles = min(rows, -(-rows // BLOCK_M) + E)
    tiles, start = [], 0
    for e in range(E):
        n = sum(1 for x in flat if x == e)
        for t0 in range(0, n, BLOCK_M):
            tiles.append((e, start + t0, start + n))
        start += n
    tiles += [(E, None, None)] * (n_tiles - len(tiles))
    return order, tiles


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("N,k,E,BLOCK_M,unused", [(1, 2, 8, 16, 0), (3, 2, 8, 16, 1), (16, 16, 32, 16, 0),
                                                  (5, 4, 6, 2, 3), (4, 16, 896, 16, 5),
                                                  (9, 3, 4, 2, 4)])
def test_schedule_matches_a_plain_construction(N, k, E, BLOCK_M, unused, path):
    """Both paths, including K3's 896 experts (the kernel's cost does not depend on E) and rows not a power of 2."""

    g = torch.Generator().manual_seed(N * 100 + k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])  # distinct experts per token
    ids.view(-1)[torch.randperm(N * k, generator=g)[:unused]] = -1
    order, tile_expert, row0, row_end = (t.cpu() for t in moe.moe_schedule(ids.to(DEVICE), E, BLOCK_M,
                                                                                   use_kernel=path == "kernel"))
    want_order, want_tiles = reference(ids, E, BLOCK_M)
    assert order.tolist() == want_order
    assert tile_expert.tolist() == [t[0] for t in want_tiles]
    live = [i for i, t in enumerate(want_tiles) if t[0] < E]
    assert [row0[i].item() for i in live] == [want_tiles[i][1] for i in live]
    assert [row_end[i].item() for i in live] == [want_tiles[i][2] for i in live]
    # `expert_tile` reads an unused tile's rows before its expert: the range must be empty (the GPU faulted on
    # uninitialised bounds)
    assert all(row0[i] >= row_end[i] for i in range(len(want_tiles)) if i not in live)
