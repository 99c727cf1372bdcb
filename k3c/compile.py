"""The compile driver: model -> IR -> passes -> memory plan and cost report -> artifact directory.

Today this builds a plan-only artifact (`--plan-only`): the final IR of both entry points, the arena plan at the
compile bounds, the persistent cache pools, the launch order, and per-op FLOPs / bytes with roofline times on the
target. Kernel generation and weights come with the code generator and runtime (issue 5). The same input gives a
byte-identical artifact (canonical JSON, no timestamps); writing is atomic (`k3c.runtime.artifact`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from k3c import __version__
from k3c.errors import UnsupportedError
from k3c.frontend import import_model
from k3c.ir import serialize
from k3c.ir.graph import Graph
from k3c.ir.ops import get_op
from k3c.ir.printer import print_graph
from k3c.ir.types import evaluate
from k3c.memory.pools import cache_pools
from k3c.passes.pipeline import run_pipeline
from k3c.passes.plan_memory import bounds_bindings, plan_graph
from k3c.runtime.artifact import ArtifactWriter
from k3c.targets import load_target, roofline
from models.config import K3Config


@dataclass
class CompileOptions:
    """Resolved options (printed by the CLI). Bounds are in sequences and tokens."""

    model: str
    out: Path
    target: str = "h200"
    tp: int = 1
    max_batch: int = 1
    max_seq: int = 4096
    max_prefill: int = 1024
    plan_only: bool = True
    force: bool = False
    dump: Path | None = None


def compile_model(opts: CompileOptions, progress=None) -> dict:
    """Compile per `opts`; returns a summary dict (arena per entry, pools, seconds). Raises K3CError subclasses."""
    if not opts.plan_only:
        raise UnsupportedError("kernel generation and weights are not built yet: pass --plan-only")
    if opts.tp != 1:
        raise UnsupportedError("tensor parallelism (--tp > 1) is planned in `k3c plan` but not compiled yet")
    t0 = time.perf_counter()
    cfg = K3Config.from_pretrained(opts.model)
    target = load_target(opts.target)
    bindings = {e: bounds_bindings(e, opts.max_batch, opts.max_seq, opts.max_prefill) for e in ("prefill", "decode")}
    graphs, passes = {}, []
    for entry in ("prefill", "decode"):  # decode gets its own pass run: absorb_mla rewrites T = 1 attention
        g = import_model(cfg, entry, progress=progress)
        graphs[entry], report = run_pipeline(g, phases=["cleanup", "model"],
                                             dump_dir=opts.dump / entry if opts.dump else None)
        passes = [r.name for r in report.passes]
    prefill = graphs["prefill"]
    writer = ArtifactWriter(opts.out, force=opts.force)
    plans, schedules, costs = {}, {}, {}
    with writer:
        for entry, g in graphs.items():
            writer.add_text(f"graph/{entry}.txt", print_graph(g))
            writer.add_text(f"graph/{entry}.json", serialize.dumps(g))
            plans[entry] = plan_graph(g, bindings[entry])
            schedules[entry] = [{"op": n.op, "inputs": [v.name for v in n.inputs], "outputs": [v.name for v in n.outputs],
                                 "layer": n.meta.get("layer")} for n in g.nodes]
            costs[entry] = cost_report(g, bindings[entry], target)
        pools = _pools(cfg, opts)
        writer.add_json("plan.json", {"bounds": {e: b for e, b in bindings.items()},
                                      "arena": {e: p.to_json() for e, p in plans.items()},
                                      "pools": {k: p.to_json() for k, p in pools.items()}})
        writer.add_json("schedule.json", schedules)
        # pass names only: timings would make two builds of the same input differ
        writer.add_json("report.json", {"target": target.name, "entries": costs,
                                        "passes": passes})
        writer.commit(config=cfg.raw, target=target.to_dict(), tp=opts.tp,
                      bounds={"max_batch": opts.max_batch, "max_seq": opts.max_seq, "max_prefill": opts.max_prefill},
                      entry_points={e: {"graph": f"graph/{e}.json"} for e in graphs},
                      extra={"k3c_version": __version__, "plan_only": True})
    return {"model": cfg.name, "nodes": len(prefill.nodes), "arena": {e: p.arena_bytes for e, p in plans.items()},
            "lower_bound": {e: p.lower_bound for e, p in plans.items()},
            "pools": {k: p.nbytes for k, p in pools.items()}, "seconds": time.perf_counter() - t0,
            "time": {e: c["total"]["roofline_s"] for e, c in costs.items()}}


def cost_report(graph: Graph, bindings: dict[str, int], target) -> dict:
    """Per op kind: count, FLOPs, bytes and roofline seconds on `target` (bf16 peak), summed over the schedule."""
    rows: dict[str, dict] = defaultdict(lambda: {"count": 0, "flops": 0, "bytes": 0})
    for n in graph.nodes:
        flops, nb = get_op(n.op).cost(n.attrs, [v.type for v in n.inputs], [v.type for v in n.outputs])
        r = rows[n.op]
        r["count"] += 1
        r["flops"] += evaluate(flops, bindings)
        r["bytes"] += evaluate(nb, bindings)
    total = {"flops": sum(r["flops"] for r in rows.values()), "bytes": sum(r["bytes"] for r in rows.values())}
    for r in list(rows.values()) + [total]:
        r["roofline_s"] = roofline(r["flops"], r["bytes"], target, "bfloat16", measured=True).time_s
    return {"ops": dict(sorted(rows.items())), "total": total}


def _pools(cfg: K3Config, opts: CompileOptions):
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    return cache_pools(max_batch=opts.max_batch, max_seq=opts.max_seq, kda_layers=kinds.count("kda"),
                       kda_heads=cfg.kda_num_heads, kda_head_dim=cfg.kda_head_dim, kda_conv_kernel=cfg.conv_kernel_size,
                       global_layers=len(kinds) - kinds.count("kda"), kv_lora_rank=cfg.kv_lora_rank,
                       qk_rope_head_dim=cfg.qk_rope_head_dim, dsa_layers=kinds.count("dsa"),
                       index_head_dim=cfg.index_head_dim, attn_res_sources=cfg.num_attn_res_sources,
                       hidden_size=cfg.hidden_size, max_tokens_in_flight=opts.max_batch * opts.max_prefill,
                       conv_dtype="float32")
