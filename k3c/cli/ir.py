"""`k3c inspect` and `k3c check`: the IR of a model at a chosen stage (text, JSON, DOT, SVG, ONNX, a summary), and
the interpretation of the graph before and after every pass."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from k3c.atomic import replacing
from k3c.cli.app import app, check_dump_dir, check_writable, compiling, err, out, progress_bars
from k3c.errors import K3CError

FORMATS = ("text", "json", "dot", "svg", "onnx", "summary")


def _import(model: str, entry: str):
    """Import MODEL into IR with a progress bar; returns (config, graph, stats). The config is read first, so a
    bad MODEL fails before torch is imported."""
    from models.config import K3Config

    cfg = K3Config.from_pretrained(model)
    compiling()
    from k3c.frontend import import_model

    stats: dict = {}
    with progress_bars() as progress:
        graph = import_model(cfg, entry, progress=lambda done, total: progress(f"importing {cfg.name}", done, total),
                             stats=stats)
    return cfg, graph, stats


def _check_after(after: str | None) -> None:
    if after is None or after == "import":
        return
    from k3c.passes.pipeline import PHASES, registered_passes

    if after not in registered_passes() and after not in PHASES:
        raise K3CError(f"--after {after}: no such pass or phase (phases: {', '.join(PHASES)}; passes: import, "
                       f"{', '.join(sorted(registered_passes()))})")


def _run_passes(graph, entry: str, after: str | None, dump: Path | None, experts_dtype: str | None = None):
    """The graph after `after`: a pass (its first run), a phase (all its passes) or, by default, the model phase;
    planned at `k3c compile`'s default bounds (--max-batch 1 --max-seq 4096 --max-prefill 1024), routed experts
    stored as `experts_dtype` (see `k3c.compile.experts_dtype`)."""
    from k3c.context import CompileContext
    from k3c.passes.pipeline import PHASES, run_pipeline

    if after == "import":
        return graph, None
    ctx = CompileContext(max_batch=1, max_seq=4096, max_prefill=1024, experts_dtype=experts_dtype).for_entry(entry)
    after = after or "model"
    # the result is verified once (as `k3c compile` does); a --dump run verifies after every pass, naming the pass
    verify = "each" if dump else "end"
    with progress_bars() as progress:
        names = list(PHASES)
        plan = PHASES if after not in PHASES else {p: PHASES[p] for p in names[:names.index(after) + 1]}
        observe = _pass_ticker(progress, "passes", sum(map(len, plan.values())))
        if after in PHASES:
            return run_pipeline(graph, names[:names.index(after) + 1], ctx=ctx, dump_dir=dump, verify=verify,
                                observe=observe)
        return run_pipeline(graph, ctx=ctx, until=after, dump_dir=dump, verify=verify, observe=observe)


def _pass_ticker(progress, step: str, total: int):
    """A `run_pipeline` observer advancing the `step` bar by one per pass."""
    count = [0]

    def observe(rec, graph) -> None:
        count[0] += rec.name != "input"
        progress(step, count[0], total)

    return observe


def summary_table(cfg, graph) -> tuple[Table, str]:
    """Op counts of a graph, and a line with its parameter bytes and layer structure."""
    from k3c.ir.types import nbytes_expr

    t = Table(title=f"{cfg.name}: {len(graph.nodes)} nodes, {len(graph.params)} parameter tensors", show_lines=False)
    t.add_column("op")
    t.add_column("count", justify="right")
    for op, n in sorted(Counter(n.op for n in graph.nodes).items(), key=lambda kv: (-kv[1], kv[0])):
        t.add_row(op, str(n))
    pbytes = sum(int(nbytes_expr(v.type)) for v in graph.params.values())
    s = cfg.summary()
    line = (f"parameters: {pbytes / 2**20:,.1f} MiB at the graph's dtypes (the meta model is f32); layers: {s['layers']} "
            f"({s['kda']} KDA, {s['mla']} MLA, {s['dsa']} DSA; {s['moe']} MoE); AttnRes sources at the readout: "
            f"{s['attn_res_sources']}")
    return t, line


@app.command()
def inspect(model: str = typer.Argument(..., help="preset name, config.json or checkpoint directory"),
            entry: str = typer.Option("prefill", help="entry point: prefill or decode"),
            after: str = typer.Option(None, help="show the IR after this pass (its first run) or phase "
                                                 "(cleanup, model, kernels, memory); default: model"),
            fmt: str = typer.Option("text", "--format", help=" | ".join(FORMATS)),
            layer: int = typer.Option(None, help="dot, svg, onnx: only this layer's nodes"),
            collapse: bool = typer.Option(False, "--collapse", help="dot, svg, onnx: one box per layer"),
            output: Path = typer.Option(None, "-o", "--output", help="write to this file instead of stdout"),
            dump: Path = typer.Option(None, help="also write the IR after every pass into this directory"),
            force: bool = typer.Option(False, "--force", help="overwrite an existing -o file")):
    """Print, draw or export the IR of MODEL at a chosen stage, or a summary table.

    dot/svg/onnx draw the whole graph; for a full-size model use --layer N (one layer) or --collapse (one box per
    layer, with a legend). onnx: standard ONNX ops where they exist, domain k3c for the rest (view it in Netron)."""
    if fmt not in FORMATS:
        raise K3CError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if fmt in ("svg", "onnx") and output is None:
        raise K3CError(f"--format {fmt} needs -o FILE.{fmt}")
    if (layer is not None or collapse) and fmt not in ("dot", "svg", "onnx"):
        raise K3CError("--layer and --collapse apply to --format dot, svg and onnx")
    if layer is not None and collapse:
        raise K3CError("--layer and --collapse exclude each other")
    if output is not None and fmt == "svg":
        output = output.with_suffix(".svg")                     # the file graphviz's drawing goes to
    if output is not None:
        check_writable(output, "-o", file=True)
    if output is not None and output.exists() and not force:
        raise K3CError(f"-o {output}: already exists (pass --force to overwrite it)")
    check_dump_dir(dump)
    if entry not in ("prefill", "decode"):
        raise K3CError(f"--entry {entry}: expected prefill or decode")
    _check_after(after)
    cfg, graph, stats = _import(model, entry)
    graph, report = _run_passes(graph, entry, after, dump, "mxfp4" if cfg.expert_quantization == "mxfp4" else "bf16")
    err.print(f"imported {cfg.name} ({entry}) in {stats['export_s'] + stats['import_s']:.1f} s"
              + (" (from the import cache)" if stats["cached"] else "") + f": {stats['nodes']} nodes"
              + (f"; passes {report.seconds:.2f} s" if report else ""))
    if fmt == "summary":
        table, line = summary_table(cfg, graph)
        if output is None:
            out.print(table, line, sep="\n", soft_wrap=True)
        else:
            with replacing(output) as tmp, tmp.open("w") as fh:
                Console(file=fh, width=120).print(table, line, sep="\n", soft_wrap=True)
            err.print(f"wrote {output}", soft_wrap=True)
        return
    if fmt == "onnx":
        import onnx

        from k3c.ir import onnx_export, views

        name = f"{cfg.name}_{entry}"
        model_proto = (onnx_export.block_to_onnx(graph, [views.layer_block(graph, layer)], name) if layer is not None
                       else onnx_export.block_to_onnx(graph, views.collapse(graph), name) if collapse
                       else onnx_export.to_onnx(graph, name))
        with replacing(output) as tmp:
            onnx.save(model_proto, tmp)
        err.print(f"wrote {output}: {len(model_proto.graph.node)} ONNX nodes", soft_wrap=True)
        return
    if fmt in ("dot", "svg"):
        from k3c.ir import nx, views  # networkx: only for drawings

        text = (nx.block_dot(graph, views.layer_block(graph, layer)) if layer is not None
                else nx.collapsed_dot(graph) if collapse else nx.to_dot(graph))
        if fmt == "svg":
            svg = nx.render(text, "svg")
            with replacing(output) as tmp:
                tmp.write_bytes(svg)
            err.print(f"wrote {output}", soft_wrap=True)
            return
    else:
        from k3c.ir import serialize
        from k3c.ir.printer import print_graph

        text = print_graph(graph) if fmt == "text" else serialize.dumps(graph, indent=1)
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        with replacing(output) as tmp:
            tmp.write_text(text)
        err.print(f"wrote {output}", soft_wrap=True)


@app.command()
def check(model: str = typer.Argument(..., help="a tiny preset or a small config (weights are random)"),
          entry: str = typer.Option("prefill"), batch: int = typer.Option(2), tokens: int = typer.Option(7),
          seed: int = typer.Option(0),
          experts_dtype: str = typer.Option(None, "--experts-dtype",
                                            help="mxfp4: round the random experts to MXFP4 and check the MXFP4 "
                                                 "graph (pack_experts) [default: as the config]"),
          kda_state: str = typer.Option("f32", "--kda-state", help="KDA recurrent state stored as f32 or bf16"),
          dsa_index_keys: str = typer.Option("bf16", "--dsa-index-keys", help="DSA index keys stored as bf16, "
                                             "fp8 (e4m3 + one f32 scale per key) or fp8-rerank (+ 4-bit residuals)")):
    """Per-pass numeric validation: interpret the graph before and after every pass on random inputs."""
    from k3c.context import CompileContext, check_dsa_index_keys, check_dsa_index_keys_for, check_kda_state
    from k3c.frontend import import_model
    from k3c.passes.pipeline import make_numeric_check, run_pipeline
    from models.checkpoint import quantize_experts_
    from models.config import K3Config
    from models.k3 import K3ForCausalLM

    if batch < 1 or tokens < 1:
        raise K3CError(f"--batch {batch} --tokens {tokens}: both must be >= 1")
    check_kda_state(kda_state)
    check_dsa_index_keys(dsa_index_keys)
    cfg = K3Config.from_pretrained(model)
    check_dsa_index_keys_for(cfg, dsa_index_keys)
    if cfg.hidden_size > 1024:
        raise K3CError(f"{model}: check interprets the model on random weights; use a tiny preset or small config")
    experts_dtype = experts_dtype or ("mxfp4" if cfg.expert_quantization == "mxfp4" else "bf16")
    if experts_dtype not in ("mxfp4", "bf16"):
        raise K3CError(f"--experts-dtype {experts_dtype}: expected mxfp4 or bf16")
    net = K3ForCausalLM(cfg).init_random_(seed)
    packed = quantize_experts_(net) if experts_dtype == "mxfp4" else {}   # the model an MXFP4 checkpoint loads
    graph = import_model(net, entry, kda_state=kda_state, dsa_index_keys=dsa_index_keys)
    weights = {k: p.detach() for k, p in net.named_parameters()} | packed
    bindings = {"B": batch, "T": tokens if entry == "prefill" else 1, "L": 5}
    t0 = time.perf_counter()
    check = make_numeric_check(bindings, seed, params=weights)
    ctx = CompileContext(max_batch=batch, max_seq=bindings["L"] + bindings["T"], max_prefill=bindings["T"],
                         experts_dtype=experts_dtype, kda_state_dtype=kda_state,
                         dsa_index_keys=dsa_index_keys).for_entry(entry)
    _, report = run_pipeline(graph, ["cleanup", "model"], ctx=ctx, numeric_check=check)
    out.print(report.table())
    out.print(f"[green]every pass preserved the outputs of {cfg.name} ({entry}, {bindings})[/] "
              f"in {time.perf_counter() - t0:.1f} s")


