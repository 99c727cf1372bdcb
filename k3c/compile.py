"""The compile driver: model -> IR -> passes -> kernels, memory plan, schedule, weights -> artifact directory.

For each entry point (prefill: last position's logits; decode; with `all_logits`, prefill_all: every position's)
the model is imported, the graph gets the compile bounds, and the pipeline runs every phase (cleanup, model,
parallel, kernels: fuse_gemms + bind_caches + form_kernels, memory: plan_memory). Each Triton kernel
group is emitted as a module under `kernels/` (with `kernels/index.json`, the kernel -> IR node sidecar); the
launch order with buffer names goes to `schedule.json`, the arena and pools to `plan.json`, per-op FLOPs / bytes and
roofline times to `report.json`, and the weights (derived ones such as MLA's absorbed matrices materialised;
routed experts as the checkpoint stores them, MXFP4 bits included, unless `experts_dtype` asks for a dequantized
build) to `weights/params.safetensors` (byte counts: plan.json's "weights"); `--report` adds what the HTML report
shows (`k3c.report.collect`: the IR after every pass, per-kernel costs) under `report/`. `kda_state_dtype` ("f32" |
"bf16") is the KDA recurrent state's storage from the import on (its pool is half the bytes in bf16), recorded in
the manifest; so is `dsa_index_keys` ("bf16" | "fp8": e4m3 index keys + f32 scale pools | "fp8-rerank": + 4-bit
residual pools, `k3c.frontend.index_keys`).
With `--tp N` the `parallel` phase splits the model (`k3c.parallel`);
one graph, schedule and plan serve every rank (the same shapes: only weights and the collectives' values differ by
rank), and rank r's weights go to `weights/rank{r}.safetensors`; the summary adds the bytes each rank communicates
per decode step (`communication`). `--plan-only` skips kernels' weights (a config or preset without a checkpoint can
only be compiled plan-only). The same input gives a byte-identical artifact; writing is atomic.
"""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from k3c import __version__
from k3c.context import ENTRIES, CompileContext, check_dsa_index_keys_for
from k3c.errors import ConfigError, UnsupportedError
from k3c.frontend import build_meta_model, import_model
from k3c.ir import serialize
from k3c.ir.graph import Graph
from k3c.ir.kernels import KernelGroup, kernel_groups
from k3c.ir.ops import get_op
from k3c.ir.printer import print_graph
from k3c.ir.types import evaluate, nbytes, torch_dtype
from k3c.memory.budget import budget
from k3c.parallel import check_layout, communication, param_split
from k3c.passes.derived import materialize_params
from k3c.passes.pack_experts import EXPERT_DTYPES
from k3c.passes.pipeline import PHASES, run_pipeline
from k3c.report.collect import PassLog, kernel_rows, report_files
from k3c.runtime.artifact import ArtifactWriter
from k3c.targets import load_target, roofline
from models.checkpoint import load_checkpoint, load_mxfp4_experts
from models.config import K3Config

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


@dataclass
class CompileOptions:
    """Resolved options (the CLI prints them). Bounds are in sequences and tokens."""

    model: str
    out: Path
    target: str = "h200"
    tp: int = 1
    max_batch: int = 1
    max_seq: int = 4096
    max_prefill: int = 1024
    plan_only: bool = False
    force: bool = False
    dump: Path | None = None
    dtype: str = "bf16"
    backend: str | None = None
    report: bool = False
    ep: int = 1  # expert groups: 1 (experts split over their width) or tp (experts partitioned); k3c.parallel
    allow_oversize: bool = False
    experts_dtype: str | None = None  # routed experts: "mxfp4" or "bf16" (dense, in `dtype`); None: as the checkpoint
    all_logits: bool = False  # also compile `prefill_all` (prefill returning every position's logits)
    kda_state_dtype: str = "f32"  # the KDA recurrent state's storage: "f32" or "bf16" (CompileContext)
    dsa_index_keys: str = "bf16"  # the DSA index-key cache: "bf16" (the model's dtype), "fp8", "fp8-rerank" (CompileContext)


def compile_model(opts: CompileOptions, progress=None) -> dict:
    """Compile per `opts`; returns a summary (nodes, kernels, arena and pools in bytes, seconds).

    `progress(step, done, total)` (optional) is called as each step advances: "import prefill" / "import decode"
    (layers), "passes prefill" / "passes decode" (passes), code generation per backend and "weights" (total None).
    The memory budget (`k3c.memory.budget`: weights + arena + pools per rank against the target's memory) is
    checked before anything is written and recorded in plan.json; summary["warning"] is its line when the
    artifact does not fit one device (a plan-only build for several GPUs, or `allow_oversize`).
    Raises ConfigError (bad model or options, a --tp / --ep that does not split the model, an artifact over the
    memory budget without `allow_oversize`), CheckpointError (bad weights), UnsupportedError (weights requested
    for a model given without a checkpoint), ArtifactError (output directory problems).
    """
    with _gc_paused():
        return _compile(opts, progress)


@contextmanager
def _gc_paused():
    """CPython's cyclic GC off while compiling: a compile builds millions of small objects that live until its
    end (FX graphs, sympy dims, IR), and each full collection walks them all again (~20% of a full-size compile).
    Cycles left behind are collected once the GC is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _compile(opts: CompileOptions, progress) -> dict:
    t0 = time.perf_counter()
    cfg = K3Config.from_pretrained(opts.model)
    fmt = experts_dtype(opts, cfg)
    check_layout(cfg, opts.tp, opts.ep, fmt)
    ctx = CompileContext(target=load_target(opts.target), dtype=opts.dtype, max_batch=opts.max_batch,
                         max_seq=opts.max_seq, max_prefill=opts.max_prefill, tp=opts.tp, ep=opts.ep,
                         backend=opts.backend, experts_dtype=fmt, kda_state_dtype=opts.kda_state_dtype,
                         dsa_index_keys=opts.dsa_index_keys).resolve()
    check_dsa_index_keys_for(cfg, opts.dsa_index_keys)
    if cfg.max_position_embeddings and opts.max_seq > cfg.max_position_embeddings:
        raise ConfigError(f"--max-seq {opts.max_seq} exceeds the model's context of {cfg.max_position_embeddings} "
                          f"tokens (config: max_position_embeddings)")
    has_weights = Path(opts.model).is_dir()
    if not opts.plan_only and not has_weights:
        raise UnsupportedError(f"{opts.model} has no weights (a preset or config.json): pass a checkpoint directory, "
                               f"or --plan-only")
    with_weights = has_weights and not opts.plan_only
    # the output location is probed first (staging directory), so an unwritable -o fails before the work
    with ArtifactWriter(opts.out, force=opts.force).open() as writer:
        model = load_checkpoint(opts.model, DTYPES[opts.dtype]) if with_weights \
            else build_meta_model(cfg).cast_(DTYPES[opts.dtype])
        packed = load_mxfp4_experts(opts.model) if with_weights and ctx.experts_dtype == "mxfp4" else {}
        ctx = ctx.replace(mxfp4_scale_max=scale_max(packed))
        graphs, passes, bindings = {}, [], {}
        log = PassLog() if opts.report else None
        tick = progress or (lambda step, done, total: None)
        entries = [e for e in ENTRIES if opts.all_logits or e != "prefill_all"]
        for entry in entries:
            ectx = ctx.for_entry(entry)
            bindings[entry] = ectx.bounds
            g = import_model(model, "decode" if entry == "decode" else "prefill",
                             progress=lambda d, t, e=entry: tick(f"import {e}", d, t),
                             logits="last" if entry == "prefill" else "all", kda_state=ctx.kda_state_dtype,
                             dsa_index_keys=ctx.dsa_index_keys)
            # verify the result only; a --dump build (debugging) verifies after every pass, naming the pass at fault
            graphs[entry], report = run_pipeline(g, ctx=ectx, verify="each" if opts.dump else "end",
                                                 dump_dir=opts.dump / entry if opts.dump else None,
                                                 observe=_observer(entry, tick, log))
            passes = [r.name for r in report.passes]
        summary = {"model": cfg.name, "nodes": {e: len(g.nodes) for e, g in graphs.items()}, "kernels": 0}
        # the memory budget before any kernel is emitted or file written: ConfigError when it may not be written
        pools = _pools(graphs["decode"], opts)
        params = {k: v.type for g in graphs.values() for k, v in _read_params(g).items()}
        fit = budget(ctx.target, sum(nbytes(t) for t in params.values()),
                     max(g.memory_plan.arena_bytes for g in graphs.values()), pools,
                     replicated=sum(nbytes(t) for k, t in params.items() if not param_split(k, ctx.ep).sharded))
        summary["warning"] = fit.check(opts.plan_only, opts.allow_oversize)
        groups = {e: kernel_groups(g) for e, g in graphs.items()}
        schedules, costs = {}, {}
        for entry, g in graphs.items():
            writer.add_text(f"graph/{entry}.txt", print_graph(g))
            writer.add_text(f"graph/{entry}.json", serialize.dumps(g))
            schedules[entry] = _schedule(g, groups[entry], ctx)
            costs[entry] = cost_report(g, bindings[entry], ctx.target)
        if not opts.plan_only:
            index = {}
            for backend in ctx.backends:
                mine = [grp for e in entries for grp in groups[e] if grp.backend == backend.name]
                if mine:
                    tick(f"generating {len(mine)} {backend.name} kernels", 0, None)
                    emitted = backend.emit(mine, ctx)
                    for rel, data in emitted.files.items():
                        (writer.add_bytes if isinstance(data, bytes) else writer.add_text)(rel, data)
                    index.update(emitted.index)
            writer.add_json("kernels/index.json", dict(sorted(index.items())))
        if log is not None:
            made = {b.name for b in ctx.backends if b.generates}
            rows = {e: kernel_rows(groups[e], bindings[e], ctx.target, opts.dtype, made) for e in graphs}
            options = {"model": cfg.name, "target": ctx.target.name, "dtype": opts.dtype,
                       "kda_state_dtype": ctx.kda_state_dtype, "dsa_index_keys": ctx.dsa_index_keys, "tp": opts.tp,
                       "max_batch": opts.max_batch, "max_seq": opts.max_seq, "max_prefill": opts.max_prefill,
                       "plan_only": opts.plan_only, "backends": [b.name for b in ctx.backends], "passes": passes}
            for path, data in report_files(log, rows, options).items():
                (writer.add_text if isinstance(data, str) else writer.add_json)(path, data)
        generating = {b.name for b in ctx.backends if b.generates}
        generated = [ln["backend"] for e in schedules.values() for ln in e["launches"] if ln["backend"] in generating]
        summary["kernels"], summary["kernel_backends"] = len(generated), sorted(set(generated))
        wbytes = weight_bytes(graphs)
        writer.add_json("plan.json", {"bounds": bindings, "arena": {e: g.memory_plan.to_json() for e, g in graphs.items()},
                                      "pools": pools, "pool_totals": pool_totals(pools), "budget": fit.to_json(),
                                      "weights": wbytes})
        writer.add_json("schedule.json", schedules)
        # pass names only: timings would make two builds of the same input differ
        writer.add_json("report.json", {"target": ctx.target.name, "entries": costs, "passes": passes,
                                        "backends": [b.name for b in ctx.backends]})
        if not opts.plan_only:
            tick("weights", 0, None)
            for rank in range(opts.tp):
                writer.add_tensors(weights_file(rank, opts.tp), _weights(model, graphs, rank, packed))
        writer.commit(config=cfg.raw, target=ctx.target.to_dict(), tp=opts.tp, bounds=ctx.bounds_json,
                      entry_points={e: {"graph": f"graph/{e}.json"} for e in graphs},
                      extra={"k3c_version": __version__, "plan_only": opts.plan_only, "dtype": opts.dtype,
                             "experts_dtype": ctx.experts_dtype, "kda_state_dtype": ctx.kda_state_dtype,
                             "dsa_index_keys": ctx.dsa_index_keys,
                             "vocab_size": cfg.vocab_size, "ep": opts.ep})
    summary.update(arena={e: g.memory_plan.arena_bytes for e, g in graphs.items()},
                   lower_bound={e: g.memory_plan.lower_bound for e, g in graphs.items()},
                   pools=pool_totals(pools), weights=wbytes, seconds=time.perf_counter() - t0,
                   time={e: c["total"]["roofline_s"] for e, c in costs.items()},
                   communication=communication(graphs["decode"], bindings["decode"], opts.tp))
    return summary


def weights_file(rank: int, tp: int) -> str:
    """The artifact path of rank `rank`'s weights: `weights/params.safetensors` at tp = 1, else
    `weights/rank{rank}.safetensors` (the runtime's `k3c.runtime.session` reads the same names)."""
    return "weights/params.safetensors" if tp == 1 else f"weights/rank{rank}.safetensors"


def _observer(entry: str, tick, log: PassLog | None):
    """run_pipeline's `observe`: advance the "passes ENTRY" progress step; record the step for the report."""
    total, done = sum(map(len, PHASES.values())), [0]
    record = log.observer(entry) if log is not None else None

    def observe(rec, graph) -> None:
        done[0] += rec.name != "input"
        tick(f"passes {entry}", done[0], total)
        if record is not None:
            record(rec, graph)

    return observe


def _schedule(g: Graph, groups: list[KernelGroup], ctx: CompileContext) -> dict:
    """schedule.json's entry for `g`: its inputs, outputs, the types of the values the launches touch, and the
    launches in order (common fields, the planned scratch buffers of `Backend.scratch`, the load-time weight
    layouts of `Backend.weight_layouts`, and the owning backend's `launch_record`); the scratch buffers' types are
    among the values."""
    backends = {b.name: b for b in ctx.backends}
    launches, used, scratch = [], set(), {}
    for group in groups:
        ln = {"name": group.name, "backend": group.backend, "kind": group.kind,
              "inputs": [v.name for v in group.inputs], "outputs": [v.name for v in group.outputs]}
        ln.update(backends[group.backend].launch_record(group))
        layouts = backends[group.backend].weight_layouts(group)
        if layouts:     # weights its kernels read re-laid at load (k3c.runtime.layouts)
            ln["weight_layouts"] = dict(sorted(layouts.items()))
        specs = backends[group.backend].scratch(group, ctx)
        if specs:  # the planned scratch buffers (plan_memory), by the name the launch function takes each under
            ln["scratch"] = {s.name: s.buffer(group.name) for s in specs}
            scratch.update((s.buffer(group.name), s.type) for s in specs)
        used.update(ln["inputs"], ln["outputs"])
        launches.append(ln)
    types = {v.name: v.type for v in g.values() if v.name in used or v in g.inputs or v in g.outputs.values()}
    values = {name: {"shape": [d if isinstance(d, int) else str(d) for d in t.shape], "dtype": t.dtype}
              for name, t in {**types, **scratch}.items()}
    return {"inputs": [v.name for v in g.inputs], "outputs": {k: v.name for k, v in g.outputs.items()},
            "values": dict(sorted(values.items())), "launches": launches}


def _read_params(g: Graph) -> dict:
    """The parameters of `g` some node reads (key -> Value): what the artifact stores and the runtime checks; a
    parameter no node reads (e.g. the norm of a one-source AttnRes) is left out."""
    read = {id(v) for n in g.nodes for v in n.inputs}
    return {k: v for k, v in g.params.items() if id(v) in read}


def experts_dtype(opts: CompileOptions, cfg: K3Config) -> str:
    """The routed experts' storage: `opts.experts_dtype`, by default the checkpoint's ("mxfp4" when its config has
    an MXFP4 quantization_config, else "bf16": dense in the artifact dtype). Raises ConfigError for an unknown
    value, or "mxfp4" asked of a dense checkpoint (k3c keeps the checkpoint's bits; it does not quantize)."""
    fmt = opts.experts_dtype or ("mxfp4" if cfg.expert_quantization == "mxfp4" else "bf16")
    if fmt not in EXPERT_DTYPES:
        raise ConfigError(f"--experts-dtype {fmt}: expected one of {', '.join(EXPERT_DTYPES)}")
    if fmt == "mxfp4" and cfg.expert_quantization != "mxfp4" and Path(opts.model).is_dir() and not opts.plan_only:
        raise ConfigError(f"--experts-dtype mxfp4: {opts.model} stores dense experts (config.json has no MXFP4 "
                          f"quantization_config); k3c keeps a checkpoint's expert bits and does not quantize")
    return fmt


def scale_max(packed: dict[str, torch.Tensor]) -> int | None:
    """The largest E8M0 scale byte among the MXFP4 expert tensors `packed` (`load_mxfp4_experts`' keys: the
    ".weight_scale" ones); None when there are none."""
    scales = [t for k, t in packed.items() if k.endswith(".weight_scale")]
    return max(int(t.max()) for t in scales) if scales else None


def weight_bytes(graphs: dict[str, Graph]) -> dict[str, int]:
    """Bytes of the artifact's weights (every parameter of any entry once, at its IR dtype: MXFP4 experts at
    4.25 bits per weight) and, of those, the routed experts'."""
    from k3c.ir.types import nbytes_expr

    params = {k: v for g in graphs.values() for k, v in g.params.items()}
    total = {k: int(nbytes_expr(v.type)) for k, v in params.items()}
    return {"total": sum(total.values()), "experts": sum(b for k, b in total.items() if ".experts.w" in k)}


def _weights(model, graphs: dict[str, Graph], rank: int, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensor of every parameter at its IR dtype: the model's, MXFP4 experts from `packed` (the
    checkpoint's bits), derived and sharded ones materialised."""
    named = {k: p.detach() for k, p in model.named_parameters()} | packed
    out: dict[str, torch.Tensor] = {}
    for g in graphs.values():
        mat = materialize_params(g, named, rank=rank)
        for key, v in _read_params(g).items():
            out[key] = mat[key].to(torch_dtype(v.type.dtype)).contiguous()
    return dict(sorted(out.items()))


def cost_report(graph: Graph, bindings: dict[str, int], target) -> dict:
    """Per op: count, FLOPs, bytes and roofline seconds on `target` (bf16 peak), summed over the schedule.

    A node's cost is a function of (op, attrs, input and output types), and the layers of one kind repeat the same
    typed nodes, so the symbolic cost is built and evaluated once per distinct signature.
    """
    rows: dict[str, dict] = defaultdict(lambda: {"count": 0, "flops": 0, "bytes": 0})
    memo: dict[tuple, tuple[int, int]] = {}
    for n in graph.nodes:
        ins, outs = tuple(v.type for v in n.inputs), tuple(v.type for v in n.outputs)
        key = (n.op, json.dumps(n.attrs, sort_keys=True), ins, outs)
        if key not in memo:
            flops, nb = get_op(n.op).cost(n.attrs, list(ins), list(outs))
            memo[key] = evaluate(flops, bindings), evaluate(nb, bindings)
        r = rows[n.op]
        r["count"] += 1
        r["flops"] += memo[key][0]
        r["bytes"] += memo[key][1]
    total = {"flops": sum(r["flops"] for r in rows.values()), "bytes": sum(r["bytes"] for r in rows.values())}
    for r in list(rows.values()) + [total]:
        r["roofline_s"] = roofline(r["flops"], r["bytes"], target, "bfloat16", measured=True).time_s
    return {"ops": dict(sorted(rows.items())), "total": total}


def _pools(decode: Graph, opts: CompileOptions) -> dict[str, dict]:
    """The persistent cache pools the runtime allocates: every cache input of the graph at (max_batch, max_seq)."""
    at = {"B": opts.max_batch, "L": opts.max_seq, "T": 1}
    pools = {}
    for v in decode.inputs:
        if v.name == "tokens":
            continue
        shp = [evaluate(d, at) for d in v.type.shape]
        n = 1
        for d in shp:
            n *= d
        pools[v.name] = {"shape": shp, "dtype": v.type.dtype, "bytes": n * torch_dtype(v.type.dtype).itemsize}
    return pools


def pool_totals(pools: dict[str, dict]) -> dict[str, int]:
    """Bytes per cache kind (kda_state, conv_state, kv, index_k) summed over layers."""
    out: dict[str, int] = defaultdict(int)
    for name, p in pools.items():
        out[name.rsplit(".", 1)[1]] += p["bytes"]
    return dict(sorted(out.items()))
