"""The expert tile schedule of `moe_experts` (k3c.codegen.triton.moe, step 1 of its module docstring): the
(token, slot) pairs sorted stably by expert and cut into tiles of BLOCK_M rows of one expert, without a host sync.
`moe_schedule` runs one `moe_schedule_kernel` launch for decode's few rows on a GPU, torch otherwise; both give
equal schedules (tests/kernels/test_triton_moe_schedule.py). Pasted into the emitted `moe_experts` modules.
Public API: `SCHEDULE_KERNEL_MAX_ROWS`, `schedule_tiles`, `moe_schedule`, `moe_schedule_kernel`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


#: `moe_schedule` runs `moe_schedule_kernel` (one launch) on a GPU up to this many (token, slot) rows (decode at
#: batch 64 with top-16); beyond, and on CPU (where Triton's interpreter sorts slowly), torch.
SCHEDULE_KERNEL_MAX_ROWS = 1024


@triton.jit
def _max_i32(a, b):
    return tl.maximum(a, b)


@triton.jit
def moe_schedule_kernel(ids_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, skey_ptr, count_ptr, R,
                        TILES, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """`moe_schedule` in one program (decode's few rows): ids int [R] -> order i64 [R], tile_expert / tile_row0 /
    tile_row_end i64 [TILES]; skey_ptr i64 [BLOCK_R] and count_ptr i64 [BLOCK_E] are scratch.

    Rows are sorted by the unique int32 key expert · BLOCK_R + row (unused slots under expert E, padding lanes
    under E + 1, so both sort last; the row in the low bits keeps the sort stable) with one bitonic `tl.sort` of
    BLOCK_R lanes, O(BLOCK_R log² BLOCK_R) whatever E. In sorted order, an expert's rows are a segment: its start
    is the running maximum of the segment boundaries (the sorted keys go through `skey_ptr` to compare each lane
    with its neighbour), its length the expert's count (`tl.histogram`, through `count_ptr`). A row whose place in
    its segment is a multiple of BLOCK_M starts a tile; tiles are numbered by a prefix sum of the starts. Tiles
    past the schedule keep expert E and the empty row range [0, 0) (`expert_tile` reads the rows before the
    expert kernels test e)."""
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    ids = tl.load(ids_ptr + r, mask=r_ok, other=-1)
    key = tl.where(r_ok, tl.where(ids >= 0, ids, E), E + 1).to(tl.int32)
    srt = tl.sort(key * BLOCK_R + r)                         # position i holds the i-th row in expert order
    skey = srt // BLOCK_R
    tl.store(order_ptr + r, (srt % BLOCK_R).to(tl.int64), mask=r_ok)
    tl.store(skey_ptr + r, skey.to(tl.int64))
    tl.store(count_ptr + tl.arange(0, BLOCK_E), tl.histogram(key, BLOCK_E).to(tl.int64))
    unused = r < TILES                                       # until a tile start claims it: expert E, no rows
    tl.store(tile_expert_ptr + r, E + 0 * r.to(tl.int64), mask=unused)
    tl.store(tile_row0_ptr + r, 0 * r.to(tl.int64), mask=unused)
    tl.store(tile_row_end_ptr + r, 0 * r.to(tl.int64), mask=unused)
    tl.debug_barrier()                                       # sorted keys, counts and the fills visible
    prev = tl.load(skey_ptr + r - 1, mask=r > 0, other=-1).to(tl.int32)
    seg_start = tl.associative_scan(tl.where(skey != prev, r, 0), 0, _max_i32)
    rank = r - seg_start
    starts = (skey < E) & (rank % BLOCK_M == 0)
    tile = tl.cumsum(starts.to(tl.int32), 0) - 1
    seg_end = seg_start + tl.load(count_ptr + skey).to(tl.int32)
    tl.store(tile_expert_ptr + tile, skey.to(tl.int64), mask=starts)
    tl.store(tile_row0_ptr + tile, r.to(tl.int64), mask=starts)
    tl.store(tile_row_end_ptr + tile, seg_end.to(tl.int64), mask=starts)


def schedule_tiles(rows: int, E: int, BLOCK_M: int) -> int:
    """The tile count of `moe_schedule` for `rows` (token, slot) pairs over E experts in tiles of BLOCK_M rows: a
    bound on the tiles the rows can need (each expert's last tile may be short), at most one a row."""
    return min(rows, triton.cdiv(rows, BLOCK_M) + E)


def moe_schedule(ids, E, BLOCK_M, use_kernel=None):
    """The tile schedule of `launch_moe_experts` for ids int [N, k] (< 0: unused) over E experts on ids' device,
    without a host sync: (order: sorted row -> flat token · k + slot index; tile_expert (E: past the schedule),
    tile_row0, tile_row_end: per tile), each i64 [`schedule_tiles`] but order [N·k].
    use_kernel: None chooses one launch of `moe_schedule_kernel` (one bitonic sort, whatever E) for ids on a GPU
    with at most SCHEDULE_KERNEL_MAX_ROWS rows (decode), else torch (a stable argsort, scatter-add counts, cumsums
    and a searchsorted: a dozen launches); True / False force either (tests; the two give equal schedules)."""
    rows = ids.numel()
    n_tiles = schedule_tiles(rows, E, BLOCK_M)
    if use_kernel is None:
        use_kernel = ids.is_cuda and rows <= SCHEDULE_KERNEL_MAX_ROWS
    if use_kernel:
        BLOCK_R, BLOCK_E = max(16, triton.next_power_of_2(rows)), triton.next_power_of_2(E + 2)
        out = torch.empty(rows + 3 * n_tiles + BLOCK_R + BLOCK_E, dtype=torch.int64, device=ids.device)
        order, tile_expert, row0, row_end, skey, count = out.split([rows, n_tiles, n_tiles, n_tiles, BLOCK_R,
                                                                    BLOCK_E])
        moe_schedule_kernel[(1,)](ids.reshape(-1), order, tile_expert, row0, row_end, skey, count, rows, n_tiles,
                                  E=E, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_E=BLOCK_E,
                                  num_warps=4 if BLOCK_R <= 256 else 8)
        return order, tile_expert, row0, row_end
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, E)               # unused slots sort last and are never scheduled
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))[:E]
    row_start = torch.cumsum(counts, 0) - counts
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = torch.cumsum(tiles, 0)
    tile = torch.arange(n_tiles, device=ids.device)
    tile_expert = torch.searchsorted(tile_end, tile, right=True)
    e = tile_expert.clamp(max=E - 1)
    return order, tile_expert, row_start[e] + (tile - (tile_end - tiles)[e]) * BLOCK_M, row_start[e] + counts[e]
