"""Pass `plan_memory` with the launches' scratch (`Backend.scratch`): k3-tiny prefill compiled for the h200 (Triton)
places every moe_experts / kda_fused / mla_attention launch's scratch in the arena at the sizes the launch functions
allocate at the bounds (formulas from the config, not from the declarations), live for that launch only, and the
arena grows by at most the largest launch's scratch; schedule.json names the buffers."""

from __future__ import annotations

import functools
import math

from k3c.context import CompileContext
from k3c.frontend import import_model
from k3c.ir.kernels import kernel_groups
from k3c.memory.planner import align_up, validate_plan
from k3c.passes.pipeline import run_pipeline
from k3c.passes.plan_memory import plan_graph
from models.config import K3Config

PRESET, B, T = "k3-tiny", 3, 24
KINDS = ("moe_experts", "kda_fused", "mla_attention")  # k3-tiny's launch kinds with scratch (no DSA layer)
CTX = CompileContext(max_batch=B, max_seq=64, max_prefill=T).resolve().for_entry("prefill")


@functools.lru_cache(maxsize=None)
def planned():
    """k3-tiny prefill (f32) through every phase at (B, T) = (3, 24) on the h200 (cached; do not change it)."""
    g, _ = run_pipeline(import_model(PRESET, "prefill", logits="last"), ctx=CTX)
    return g


def expected_scratch(kind: str, itemsize: int, absorbed: bool = False) -> dict[str, int]:
    """Bytes of each scratch buffer one launch of `kind` allocates at (B, T), activations of `itemsize` bytes, from
    the config: launch_moe_experts (k3c/codegen/triton/moe.py), the chunked path of kda._launch_kda, and the split-K
    partials of attention.launch_mla at their bound (split_rows: < 2·264 rows absorbed, < 2·32·264 / H else, and at
    most 64 splits per query row)."""
    c = K3Config.from_pretrained(PRESET)
    if kind == "mla_attention":
        H = c.num_attention_heads
        rows = min(B * T * 64, 2 * 264 if absorbed else math.ceil(64 * 264 / H))
        DV = c.kv_lora_rank if absorbed else c.v_head_dim
        return {"o_part": rows * H * DV * 4, "lse": rows * H * 4}
    if kind == "moe_experts":
        rows = B * T * c.num_experts_per_token
        return {"h": rows * c.moe_intermediate_size * itemsize, "y_slot": rows * c.routed_expert_hidden_size * 4}
    H, D, NC = c.kda_num_heads, c.kda_head_dim, math.ceil(T / 16)
    out = {"ws": 4 * B * H * NC * 16 * D * itemsize, "ws_p": B * H * NC * 16 * 16 * itemsize,
           "ws_glast": B * H * NC * D * 4}
    if D > 64:  # the state pass splits the value dim (CHUNK_BLOCK_V = 64): the norm epilogue's o_buf (act. dtype)
        out["o_buf"] = B * T * H * D * itemsize
    return out


def test_scratch_of_moe_and_kda_launches_is_planned_at_the_bounds():
    g = planned()
    plan = g.memory_plan
    sizes = {b.name: b for b in plan.buffers}
    seen = {"moe_experts": 0, "kda_fused": 0, "mla_attention": 0}
    for i, group in enumerate(kernel_groups(g)):
        mine = {n.split(".scratch.")[1]: b for n, b in sizes.items() if n.startswith(f"{group.name}.scratch.")}
        if group.kind in seen:
            seen[group.kind] += 1
            want = expected_scratch(group.kind, 4, group.nodes[0].attrs.get("absorbed", False))
            assert {k: b.nbytes for k, b in mine.items()} == want, group.name
            assert all((b.first, b.last) == (i, i) for b in mine.values())  # live at its launch only
        else:
            assert not mine, group.name
    c = K3Config.from_pretrained(PRESET)
    assert seen == {"moe_experts": c.num_hidden_layers - c.first_k_dense_replace, "kda_fused": len(c.kda_layers),
                    "mla_attention": c.num_hidden_layers - len(c.kda_layers)}
    validate_plan(plan)


def test_arena_grows_by_at_most_the_largest_launch_scratch():
    g = planned()
    plan, without = g.memory_plan, plan_graph(g, CTX.bounds)
    scratch = [b for b in plan.buffers if ".scratch." in b.name]
    per_launch: dict[int, int] = {}
    for b in scratch:
        per_launch[b.first] = per_launch.get(b.first, 0) + align_up(b.nbytes, plan.alignment)
    assert len(plan.buffers) == len(without.buffers) + len(scratch)
    assert without.arena_bytes <= plan.arena_bytes <= without.arena_bytes + max(per_launch.values())
    assert plan.lower_bound >= max(per_launch.values())


def test_schedule_names_the_planned_scratch():
    """schedule.json's launches (`k3c.compile._schedule`): a moe_experts / kda_fused / mla_attention launch's
    "scratch" maps each name its launch function takes to a planned buffer whose type (in "values") sizes it at the
    bounds as planned; other launches have no such field."""
    from k3c.compile import _schedule
    from k3c.ir.types import TensorType, nbytes

    g = planned()
    sched, sizes = _schedule(g, kernel_groups(g), CTX), {b.name: b.nbytes for b in g.memory_plan.buffers}
    named = 0
    for ln in sched["launches"]:
        if ln["kind"] not in KINDS:
            assert "scratch" not in ln
            continue
        named += 1
        assert set(ln["scratch"]) == set(expected_scratch(ln["kind"], 4))
        for buf in ln["scratch"].values():
            t = sched["values"][buf]
            assert nbytes(TensorType(tuple(t["shape"]), t["dtype"]), CTX.bounds) == sizes[buf]
    assert named == sum(g.kind in KINDS for g in kernel_groups(g))
