"""Static memory planning: give every transient buffer of a kernel schedule an offset in one arena.

IR-independent: the input is a list of `Buffer(name, nbytes, first, last)` where `first` and `last` are the
indices of the first and last kernel launch (in schedule order) that touch the buffer; a buffer is live on the
closed interval `[first, last]`, so two buffers whose intervals intersect must not share bytes. Sizes are rounded
up to the alignment (256 B by default, DESIGN.md "plan_memory"), offsets are multiples of it.

Algorithm (offline dynamic storage allocation, NP-hard in general, so greedy heuristics). Each strategy is an
order; buffers are placed one by one among the already-placed buffers whose lifetimes intersect theirs, either at
the lowest gap that fits (first fit) or in the smallest gap that fits (best fit, lowest offset on ties), else on
top of them:
- "size":    aligned size desc, then lifetime length desc, then name; first fit (the primary strategy);
- "area":    size × lifetime desc; best fit;
- "breadth": peak live bytes over the buffer's lifetime desc, then size (greedy by breadth, Pisarchyk & Lee 2020,
             "Efficient Memory Management for Deep Neural Net Inference"); best fit;
- "start":   first use asc, then size desc; best fit.
(Fits chosen by measurement on synthetic schedules, `python -m k3c.memory.synthetic`.) The smallest arena wins,
earlier strategies on ties; the search stops once a strategy is within `stop_ratio` of the lower bound. A final
compaction pass (first fit in order of offset) can only shrink the winner. Names break every tie, so the plan is
deterministic. Conflicts come from an offline segment tree over launch indices plus the buffers sorted by start,
so the cost is O(n log n + conflicting pairs), not O(n^2).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from itertools import chain, compress
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from k3c.errors import IRError

DEFAULT_ALIGNMENT = 256
STRATEGIES = ("size", "area", "breadth", "start")
_FIRST_FIT = {"size": True, "area": False, "breadth": False, "start": False}  # else best fit (measured choice)
_VECTOR_MIN = 64  # conflicts above which the gap search runs in numpy
_NO_FIT = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Buffer:
    """A transient buffer: `nbytes` (bytes, unaligned), live on launches `first..last` (inclusive, 0-based)."""

    name: str
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryPlan:
    """The result of planning.

    arena_bytes:    size of the one arena (bytes, a multiple of `alignment`).
    offsets:        buffer name -> byte offset in the arena (a multiple of `alignment`).
    lower_bound:    max over launches of the sum of aligned sizes of the buffers live there (bytes); no valid
                    plan has a smaller arena.
    no_reuse_bytes: sum of aligned sizes (bytes): the arena if nothing were shared.
    buffers:        the input buffers, in input order.
    alignment:      the alignment used (bytes).
    strategy:       the ordering that produced this plan (one of STRATEGIES, "+compact" if compaction shrank it).
    """

    arena_bytes: int
    offsets: dict[str, int]
    lower_bound: int
    no_reuse_bytes: int
    buffers: tuple[Buffer, ...]
    alignment: int = DEFAULT_ALIGNMENT
    strategy: str = "size"

    def to_json(self) -> dict:
        """Plain JSON data for plan.json: arena, bounds, and buffer -> {offset, bytes, first, last}."""
        return {
            "arena_bytes": self.arena_bytes,
            "lower_bound": self.lower_bound,
            "no_reuse_bytes": self.no_reuse_bytes,
            "alignment": self.alignment,
            "strategy": self.strategy,
            "buffers": {
                b.name: {"offset": self.offsets[b.name], "bytes": b.nbytes, "first": b.first, "last": b.last}
                for b in self.buffers
            },
        }


def align_up(nbytes: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= `nbytes`."""
    return -(-nbytes // alignment) * alignment


def _check_inputs(buffers: Iterable[Buffer], alignment: int) -> tuple[Buffer, ...]:
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise IRError(f"memory plan: alignment must be a positive power of two, got {alignment!r}")
    bufs = tuple(buffers)
    if len({b.name for b in bufs}) != len(bufs):
        seen: set[str] = set()
        dup = next(b.name for b in bufs if b.name in seen or seen.add(b.name))
        raise IRError(f"memory plan: duplicate buffer name '{dup}'")
    for b in bufs:
        if not isinstance(b, Buffer):
            raise IRError(f"memory plan: expected Buffer, got {type(b).__name__}")
        if not (type(b.nbytes) is int and type(b.first) is int and type(b.last) is int
                and b.nbytes >= 0 and 0 <= b.first <= b.last):
            raise IRError(f"memory plan: buffer '{b.name}': need ints with nbytes >= 0 and 0 <= first <= last, "
                          f"got nbytes={b.nbytes!r}, first={b.first!r}, last={b.last!r}")
    return bufs


def _live_profile(firsts: list[int], lasts: list[int], sizes: list[int], ntimes: int) -> list[int]:
    """Live aligned bytes at each compressed time index (difference array + prefix sum)."""
    diff = [0] * (ntimes + 1)
    for f, l, s in zip(firsts, lasts, sizes):
        diff[f] += s
        diff[l + 1] -= s
    live, acc = [0] * ntimes, 0
    for t in range(ntimes):
        acc += diff[t]
        live[t] = acc
    return live


def _range_max(values: list[int], queries: list[tuple[int, int]]) -> list[int]:
    """max(values[a..b]) for each (a, b), with a sparse table (O(T log T) build, O(1) per query)."""
    table = [values]
    k = 1
    while 2 * k <= len(values):
        prev = table[-1]
        table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
        k *= 2
    out = []
    for a, b in queries:
        level = (b - a + 1).bit_length() - 1
        row = table[level]
        out.append(max(row[a], row[b - (1 << level) + 1]))
    return out


def _best_fit_np(ids: np.ndarray, size: int, off_np: np.ndarray, end_np: np.ndarray, first_fit: bool) -> int:
    """Vectorised gap search (best or first fit) over many conflicting spans: same answer as `_place`'s loop."""
    lo = off_np[ids]
    order = np.argsort(lo, kind="stable")
    lo = lo[order]
    top = np.maximum.accumulate(end_np[ids][order])
    below = np.concatenate(([0], top[:-1]))
    gap = lo - below
    fits = gap >= size
    if not fits.any():
        return int(top[-1])
    if first_fit:
        return int(below[np.argmax(fits)])
    return int(below[np.argmin(np.where(fits, gap, _NO_FIT))])


@dataclass(frozen=True)
class _ConflictIndex:
    """Offline index of all buffers' lifetimes, shared by every strategy.

    Buffer j meets [f, l] iff j is live at f or j starts in (f, l]. Live-at-f: a segment tree over time indices
    whose node lists hold the buffers whose lifetime covers the node's range (each lifetime is split into
    O(log T) canonical nodes); the nodes on f's leaf-to-root path hold exactly the buffers live at f.
    Starts-in-(f, l]: the slice by_start[start_lo[i]:start_hi[i]] of the buffers sorted by first use.
    Queries return all buffers, placed or not; `_place` keeps the placed ones.
    """

    paths: list[list[list[int]]]  # time index -> the non-empty node lists on its leaf-to-root path
    by_start: list[int]
    start_lo: list[int]
    start_hi: list[int]


def _conflict_index(firsts: list[int], lasts: list[int], ntimes: int) -> _ConflictIndex:
    leaf0 = 1 << max(ntimes - 1, 0).bit_length()
    f = np.asarray(firsts, dtype=np.int64)
    l = np.asarray(lasts, dtype=np.int64)
    ids = np.arange(len(firsts), dtype=np.int64)
    lo, hi = f + leaf0, l + leaf0 + 1
    nodes, owners = [], []
    while True:  # the canonical-node loop of a bottom-up segment tree, for all buffers at once
        active = lo < hi
        if not active.any():
            break
        take = active & (lo & 1 == 1)
        nodes.append(lo[take])
        owners.append(ids[take])
        lo = lo + take
        take = active & (hi & 1 == 1)
        hi = hi - take
        nodes.append(hi[take])
        owners.append(ids[take])
        lo >>= 1
        hi >>= 1
    tree: list = [()] * (2 * leaf0)
    if nodes:
        node_arr, owner_arr = np.concatenate(nodes), np.concatenate(owners)
        order = np.lexsort((owner_arr, node_arr))
        node_arr, owner_arr = node_arr[order], owner_arr[order]
        keys, starts = np.unique(node_arr, return_index=True)
        owner_list, bounds = owner_arr.tolist(), starts.tolist() + [len(owner_arr)]
        for k, key in enumerate(keys.tolist()):
            tree[key] = owner_list[bounds[k] : bounds[k + 1]]
    paths = []
    for t in range(ntimes):
        node, path = t + leaf0, []
        while node:
            if tree[node]:
                path.append(tree[node])
            node >>= 1
        paths.append(path)
    by_start = np.lexsort((ids, f))
    sorted_f = f[by_start]
    return _ConflictIndex(paths, by_start.tolist(), np.searchsorted(sorted_f, f, side="right").tolist(),
                          np.searchsorted(sorted_f, l, side="right").tolist())


def _place(order: list[int], sizes: list[int], firsts: list[int], index: _ConflictIndex,
           first_fit: bool = False) -> tuple[list[int], int]:
    """Place buffers in `order` in the smallest gap that fits (best fit; `first_fit`: the lowest gap that fits)
    among already-placed conflicting buffers, else on top of them; returns (offsets, arena)."""
    n = len(sizes)
    offsets, ends, placed = [0] * n, [0] * n, bytearray(n)
    off_np, end_np = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    paths, by_start, start_lo, start_hi = index.paths, index.by_start, index.start_lo, index.start_hi
    is_placed = placed.__getitem__
    arena = 0
    for i in order:
        size = sizes[i]
        if size == 0:
            continue
        near = list(chain.from_iterable(paths[firsts[i]]))
        near += by_start[start_lo[i] : start_hi[i]]
        conflicts = list(compress(near, map(is_placed, near)))
        if len(conflicts) > _VECTOR_MIN:
            off = _best_fit_np(np.array(conflicts), size, off_np, end_np, first_fit)
        else:
            conflicts.sort(key=offsets.__getitem__)
            best, best_gap, top = -1, -1, 0
            for j in conflicts:
                gap = offsets[j] - top
                if gap >= size and (best < 0 or gap < best_gap):
                    best, best_gap = top, gap
                    if first_fit or gap == size:
                        break
                if ends[j] > top:
                    top = ends[j]
            off = top if best < 0 else best
        offsets[i] = off_np[i] = off
        ends[i] = end_np[i] = off + size
        placed[i] = 1
        if off + size > arena:
            arena = off + size
    return offsets, arena


def plan_arena(buffers: Iterable[Buffer], alignment: int = DEFAULT_ALIGNMENT,
               strategies: tuple[str, ...] = STRATEGIES, stop_ratio: float = 1.01) -> MemoryPlan:
    """Plan offsets for `buffers` in one arena; deterministic (same input -> same offsets).

    Args: buffers (unique names); alignment in bytes (a power of two); orderings to try, in order (a non-empty
    subset of STRATEGIES); stop_ratio: stop trying further orderings once arena <= stop_ratio × lower bound
    (1.0: try all unless one is optimal).
    Returns: a MemoryPlan with the smallest arena found; plan.strategy names the ordering ("+compact" when
    the final compaction pass shrank it).
    Raises: IRError on a bad alignment, a duplicate name, a negative size/index, last < first, unknown strategy.
    """
    bufs = _check_inputs(buffers, alignment)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise IRError(f"memory plan: unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    n = len(bufs)
    sizes = [align_up(b.nbytes, alignment) for b in bufs]
    times = sorted({b.first for b in bufs} | {b.last for b in bufs})
    rank = {t: k for k, t in enumerate(times)}
    firsts = [rank[b.first] for b in bufs]
    lasts = [rank[b.last] for b in bufs]
    live = _live_profile(firsts, lasts, sizes, len(times))
    lower_bound = max(live, default=0)
    names = [b.name for b in bufs]
    length = [b.last - b.first for b in bufs]
    peak: list[int] = []
    keys = {
        "size": lambda i: (-sizes[i], -length[i], names[i]),
        "area": lambda i: (-sizes[i] * (length[i] + 1), -sizes[i], names[i]),
        "breadth": lambda i: (-peak[i], -sizes[i], -length[i], names[i]),
        "start": lambda i: (bufs[i].first, -sizes[i], -length[i], names[i]),
    }
    index = _conflict_index(firsts, lasts, len(times))
    best_offsets, best_arena, best_name = [0] * n, 0, strategies[0]
    for k, strategy in enumerate(strategies):
        if strategy == "breadth" and not peak:
            peak = _range_max(live, list(zip(firsts, lasts)))
        order = sorted(range(n), key=keys[strategy])
        offsets, arena = _place(order, sizes, firsts, index, first_fit=_FIRST_FIT[strategy])
        if k == 0 or arena < best_arena:
            best_offsets, best_arena, best_name = offsets, arena, strategy
        if arena <= stop_ratio * lower_bound:
            break
    if best_arena > lower_bound and not _FIRST_FIT[best_name]:
        # Compaction: re-place in order of offset, each at the lowest gap that fits. Every buffer can stay where
        # it was (the buffers below it only moved down), so the arena never grows.
        order = sorted(range(n), key=lambda i: (best_offsets[i], names[i]))
        offsets, arena = _place(order, sizes, firsts, index, first_fit=True)
        if arena < best_arena:
            best_offsets, best_arena, best_name = offsets, arena, best_name + "+compact"
    return MemoryPlan(
        arena_bytes=best_arena,
        offsets={names[i]: best_offsets[i] for i in range(n)},
        lower_bound=lower_bound,
        no_reuse_bytes=sum(sizes),
        buffers=bufs,
        alignment=alignment,
        strategy=best_name,
    )


def validate_plan(plan: MemoryPlan) -> None:
    """Check a plan; raise IRError naming the first problem found.

    Checked: every buffer has an offset; offsets are multiples of the alignment; every buffer lies in
    [0, arena_bytes); no two buffers with intersecting lifetimes share a byte; lower_bound <= arena_bytes.
    O(n log n): a sweep over launches keeping live buffers sorted by offset, so each new buffer is compared
    with its neighbours in address order only.
    """
    a = plan.alignment
    if a <= 0 or a & (a - 1):
        raise IRError(f"memory plan: alignment {a} is not a positive power of two")
    spans = []
    for b in plan.buffers:
        if b.name not in plan.offsets:
            raise IRError(f"memory plan: buffer '{b.name}' has no offset")
        off = plan.offsets[b.name]
        size = align_up(b.nbytes, a)
        if off < 0 or off % a:
            raise IRError(f"memory plan: buffer '{b.name}' offset {off} is not a non-negative multiple of {a}")
        if off + size > plan.arena_bytes:
            raise IRError(f"memory plan: buffer '{b.name}' [{off}, {off + size}) exceeds the arena "
                          f"({plan.arena_bytes} bytes)")
        if size:
            spans.append((b.first, b.last, off, off + size, b.name))
    if plan.lower_bound > plan.arena_bytes:
        raise IRError(f"memory plan: arena {plan.arena_bytes} is below the lower bound {plan.lower_bound}")
    # Sweep by start time; `active` holds (offset, end, last, name) of live buffers sorted by offset, `expiry` a
    # heap of the same by last use. Live buffers never overlap each other (checked on insertion), so their ends
    # are sorted too and a new buffer only needs comparing with its two neighbours in address order.
    spans.sort()
    active: list[tuple[int, int, int, str]] = []
    expiry: list[tuple[int, int, int, str]] = []
    for first, last, off, end, name in spans:
        while expiry and expiry[0][0] < first:
            gone_last, gone_off, gone_end, gone_name = heapq.heappop(expiry)
            del active[bisect_left(active, (gone_off, gone_end, gone_last, gone_name))]
        item = (off, end, last, name)
        pos = bisect_right(active, item)
        for other in active[max(pos - 1, 0) : pos + 1]:
            if other[0] < end and off < other[1]:
                raise IRError(f"memory plan: buffers '{name}' and '{other[3]}' are live at the same time and "
                              f"overlap in bytes [{max(off, other[0])}, {min(end, other[1])})")
        active.insert(pos, item)
        heapq.heappush(expiry, (last, off, end, name))
