"""Static memory planning: transient buffers packed into one arena (planner), persistent cache pools (pools) and
the compile-time memory budget (budget)."""

from k3c.memory.planner import DEFAULT_ALIGNMENT, Buffer, MemoryPlan, align_up, plan_arena, validate_plan
from k3c.memory.pools import Pool, attn_res_sources, cache_pools, pools_total_bytes

__all__ = [
    "DEFAULT_ALIGNMENT", "Buffer", "MemoryPlan", "align_up", "plan_arena", "validate_plan",
    "Pool", "attn_res_sources", "cache_pools", "pools_total_bytes",
]
