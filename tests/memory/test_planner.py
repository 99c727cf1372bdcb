"""The static memory planner: hand cases with known optimal arenas, properties on random interval sets, speed."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3c.errors import IRError
from k3c.memory.planner import STRATEGIES, Buffer, MemoryPlan, align_up, plan_arena, validate_plan
from k3c.memory.synthetic import random_schedule, transformer_schedule

KiB = 1024


def _plan(specs, **kw):
    return plan_arena([Buffer(name, size, first, last) for name, size, first, last in specs], **kw)


def _brute_lower_bound(buffers, alignment):
    """Peak live aligned bytes by checking every launch index (independent of the planner's sweep)."""
    last = max(b.last for b in buffers)
    return max(sum(align_up(b.nbytes, alignment) for b in buffers if b.first <= t <= b.last) for t in range(last + 1))


def test_chain_reuses_every_other_buffer():
    # A -> B -> C, each live for two launches: A and C never meet, so the optimum is 2 buffers' worth.
    plan = _plan([("A", 1000, 0, 1), ("B", 1000, 1, 2), ("C", 1000, 2, 3)])
    validate_plan(plan)
    assert plan.arena_bytes == 2048 and plan.lower_bound == 2048
    assert plan.offsets["A"] == plan.offsets["C"] != plan.offsets["B"]
    assert plan.no_reuse_bytes == 3 * 1024


def test_disjoint_lifetimes_share_offset_zero():
    plan = _plan([("a", 100, 0, 0), ("b", 5000, 1, 1), ("c", 300, 2, 2)])
    assert plan.offsets == {"a": 0, "b": 0, "c": 0}
    assert plan.arena_bytes == align_up(5000, 256) == 5120


def test_all_overlapping_is_the_sum():
    specs = [(f"x{i}", 256 * (i + 1), 0, 5) for i in range(6)]
    plan = _plan(specs)
    validate_plan(plan)
    assert plan.arena_bytes == 256 * 21 == plan.no_reuse_bytes == plan.lower_bound


def test_long_buffer_and_two_halves():
    # C spans everything; A and B split the time, so they share one slot: optimum 3 KiB.
    plan = _plan([("A", KiB, 0, 4), ("B", KiB, 5, 9), ("C", 2 * KiB, 0, 9)])
    validate_plan(plan)
    assert plan.arena_bytes == 3 * KiB and plan.offsets["A"] == plan.offsets["B"]


def test_alignment_and_zero_sized_buffers():
    plan = _plan([("z", 0, 0, 3), ("a", 1, 0, 3), ("b", 513, 0, 3)], alignment=512)
    validate_plan(plan)
    assert plan.arena_bytes == 512 + 1024 and all(o % 512 == 0 for o in plan.offsets.values())


def test_empty_input():
    plan = plan_arena([])
    assert (plan.arena_bytes, plan.lower_bound, plan.no_reuse_bytes, plan.offsets) == (0, 0, 0, {})


@pytest.mark.parametrize("specs, alignment, match", [
    ([("a", 1, 0, 0), ("a", 1, 1, 1)], 256, "duplicate"),
    ([("a", -1, 0, 0)], 256, "nbytes"),
    ([("a", 1, 3, 2)], 256, "first"),
    ([("a", 1, 0, 0)], 100, "power of two"),
])
def test_bad_inputs_raise(specs, alignment, match):
    with pytest.raises(IRError, match=match):
        _plan(specs, alignment=alignment)


def test_unknown_strategy_raises():
    with pytest.raises(IRError, match="unknown strategies"):
        _plan([("a", 1, 0, 0)], strategies=("magic",))


def _corrupt(plan, **offsets):
    return MemoryPlan(plan.arena_bytes, {**plan.offsets, **offsets}, plan.lower_bound, plan.no_reuse_bytes,
                      plan.buffers, plan.alignment, plan.strategy)


def test_validate_catches_overlap_misalignment_and_overflow():
    plan = _plan([("A", 1000, 0, 1), ("B", 1000, 1, 2), ("C", 1000, 2, 3)])
    with pytest.raises(IRError, match="'B' and 'A'|'A' and 'B'"):
        validate_plan(_corrupt(plan, B=plan.offsets["A"]))
    with pytest.raises(IRError, match="multiple of 256"):
        validate_plan(_corrupt(plan, A=128))
    with pytest.raises(IRError, match="exceeds the arena"):
        validate_plan(_corrupt(plan, C=2048))
    validate_plan(_corrupt(plan, C=plan.offsets["A"]))  # A and C never meet: sharing is fine


intervals = st.lists(
    st.tuples(st.integers(0, 70_000), st.integers(0, 40), st.integers(0, 12)), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(intervals, st.sampled_from([1, 64, 256, 4096]))
def test_random_interval_sets(specs, alignment):
    buffers = [Buffer(f"b{i}", size, first, first + span) for i, (size, first, span) in enumerate(specs)]
    plan = plan_arena(buffers, alignment=alignment)
    validate_plan(plan)
    no_reuse = sum(align_up(b.nbytes, alignment) for b in buffers)
    lower = _brute_lower_bound(buffers, alignment) if buffers else 0
    assert plan.lower_bound == lower
    assert lower <= plan.arena_bytes <= no_reuse == plan.no_reuse_bytes
    assert all(off % alignment == 0 for off in plan.offsets.values())
    again = plan_arena(list(buffers), alignment=alignment)
    assert again.offsets == plan.offsets and again.arena_bytes == plan.arena_bytes
    for strategy in STRATEGIES:  # every strategy alone is valid too
        validate_plan(plan_arena(buffers, alignment=alignment, strategies=(strategy,)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 8)), min_size=1, max_size=50))
def test_equal_sizes_reach_the_lower_bound(specs):
    # Interval graphs are perfect: with equal sizes the optimum is exactly the peak live bytes, and placing in
    # order of first use (the "start" strategy) attains it.
    buffers = [Buffer(f"b{i}", 3000, f, f + s) for i, (f, s) in enumerate(specs)]
    plan = plan_arena(buffers, stop_ratio=1.0)
    validate_plan(plan)
    assert plan.arena_bytes == plan.lower_bound == _brute_lower_bound(buffers, 256)


def test_input_order_does_not_change_the_plan():
    bufs = random_schedule(500, seed=7)
    assert plan_arena(bufs).offsets == plan_arena(list(reversed(bufs))).offsets


@pytest.mark.parametrize("layers, tokens, experts", [(24, 4096, 0), (93, 8192, 0), (40, 4096, 48)])
def test_transformer_schedules_within_five_percent(layers, tokens, experts):
    plan = plan_arena(transformer_schedule(layers, tokens, expert_launches=experts))
    validate_plan(plan)
    assert plan.arena_bytes <= 1.05 * plan.lower_bound
    assert plan.no_reuse_bytes > 20 * plan.lower_bound  # reuse matters on these schedules


def test_twenty_thousand_buffers_plan_fast():
    bufs = transformer_schedule(93, 4096, expert_launches=48, seed=3)
    assert len(bufs) > 20_000
    start = time.process_time()  # CPU time of this process: robust to other load on the machine
    plan = plan_arena(bufs)
    elapsed = time.process_time() - start
    validate_plan(plan)
    assert plan.arena_bytes <= 1.05 * plan.lower_bound
    # ~0.2 s measured alone; CPU time still grows with cache contention on a shared 2-core machine (1.15 s seen), so
    # the bound only catches a quadratic planner (~10x slower), not noise
    assert elapsed < 4.0, f"planning {len(bufs)} buffers took {elapsed:.2f} s of CPU"


def test_plan_json_round_trip_fields():
    plan = _plan([("A", 1000, 0, 1), ("B", 10, 1, 2)])
    data = plan.to_json()
    assert data["buffers"]["A"] == {"offset": plan.offsets["A"], "bytes": 1000, "first": 0, "last": 1}
    assert data["arena_bytes"] == plan.arena_bytes == 1280 and data["alignment"] == 256
