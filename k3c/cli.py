"""The `k3c` command line. Every error k3c raises on purpose (`K3CError`) is printed here as one line, exit 2.

    k3c init PRESET -o DIR [--seed 0] [--dtype f32|bf16]      a random checkpoint in the published layout
    k3c compile MODEL -o ART [--report FILE.html] ...         an artifact (and its HTML report)
    k3c run ART [--tokens 1,2,3] [--decode-steps 8]           prefill + greedy decode
    k3c report ART -o report.html                             the compile report of an artifact
    k3c inspect MODEL [--entry prefill|decode] [--after PASS] [--format text|json|dot|svg|onnx|summary]
                      [--layer N | --collapse] [-o FILE]
    k3c check MODEL [--entry ...] [--batch 2] [--tokens 7]     interpret before/after every pass on random weights
    k3c plan MODEL [--tp 1,2,4,8]                             memory per GPU and a decode roofline

Start-up is kept short (`k3c --help` and argument errors well under a second): torch and the compiler are
imported inside the commands that need them, after the arguments are checked. Progress bars go to stderr and
only when it is a terminal.

MODEL is a preset name (k3-tiny, k3.1-pro-tiny, kimi-linear-tiny, k3, k3.1-pro, kimi-linear-48b), a config.json, or a
checkpoint directory. Without weights the model is built on the meta device (no memory), which is how full-size
configurations are inspected.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from k3c import __version__
from k3c.errors import K3CError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="k3c: ahead-of-time compiler for the Kimi K3 family")
err = Console(stderr=True)
out = Console()
FORMATS = ("text", "json", "dot", "svg", "onnx", "summary")


@contextmanager
def progress_bars():
    """A `progress(step, done, total)` callback drawing one transient bar per step name on stderr (nothing when
    stderr is not a terminal). `total` None: a spinner-like bar without a count."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def update(step: str, done: int, total: int | None) -> None:
            if step not in tasks:
                tasks[step] = bar.add_task(step, total=total)
            bar.update(tasks[step], completed=done, total=total)

        yield update


def _compiling() -> None:
    """Before a long compiler command: CPython's cyclic GC off until the command returns (`main` turns it back on;
    the IR and the FX graphs are millions of small objects that live until the end, and each full collection would
    walk them again)."""
    gc.disable()


def _import(model: str, entry: str):
    """Import MODEL into IR with a progress bar; returns (config, graph, stats). The config is read first, so a
    bad MODEL fails before torch is imported."""
    from models.config import K3Config

    cfg = K3Config.from_pretrained(model)
    _compiling()
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
    if output is not None and output.is_dir():
        raise K3CError(f"-o {output}: is a directory; give a file name")
    if output is not None and output.exists() and not force:
        raise K3CError(f"-o {output}: already exists (pass --force to overwrite it)")
    _check_after(after)
    cfg, graph, stats = _import(model, entry)
    graph, report = _run_passes(graph, entry, after, dump, "mxfp4" if cfg.expert_quantization == "mxfp4" else "bf16")
    err.print(f"imported {cfg.name} ({entry}) in {stats['export_s'] + stats['import_s']:.1f} s: {stats['nodes']} nodes"
              + (f"; passes {report.seconds:.2f} s" if report else ""))
    if fmt == "summary":
        table, line = summary_table(cfg, graph)
        if output is None:
            out.print(table, line, sep="\n", soft_wrap=True)
        else:
            with output.open("w") as fh:
                Console(file=fh, width=120).print(table, line, sep="\n", soft_wrap=True)
            err.print(f"wrote {output}")
        return
    if fmt == "onnx":
        import onnx

        from k3c.ir import onnx_export, views

        name = f"{cfg.name}_{entry}"
        model_proto = (onnx_export.block_to_onnx(graph, [views.layer_block(graph, layer)], name) if layer is not None
                       else onnx_export.block_to_onnx(graph, views.collapse(graph), name) if collapse
                       else onnx_export.to_onnx(graph, name))
        onnx.save(model_proto, output)
        err.print(f"wrote {output}: {len(model_proto.graph.node)} ONNX nodes")
        return
    from k3c.ir import nx, serialize, views
    from k3c.ir.printer import print_graph

    if fmt in ("dot", "svg"):
        text = (nx.block_dot(graph, views.layer_block(graph, layer)) if layer is not None
                else nx.collapsed_dot(graph) if collapse else nx.to_dot(graph))
        if fmt == "svg":
            nx.render(text, output, "svg")
            err.print(f"wrote {output}")
            return
    else:
        text = print_graph(graph) if fmt == "text" else serialize.dumps(graph, indent=1)
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        output.write_text(text)
        err.print(f"wrote {output}")


@app.command()
def check(model: str = typer.Argument(..., help="a tiny preset or a small config (weights are random)"),
          entry: str = typer.Option("prefill"), batch: int = typer.Option(2), tokens: int = typer.Option(7),
          seed: int = typer.Option(0),
          experts_dtype: str = typer.Option(None, "--experts-dtype",
                                            help="mxfp4: round the random experts to MXFP4 and check the MXFP4 "
                                                 "graph (pack_experts) [default: as the config]")):
    """Per-pass numeric validation: interpret the graph before and after every pass on random inputs."""
    from k3c.context import CompileContext
    from k3c.frontend import import_model
    from k3c.passes.pipeline import make_numeric_check, run_pipeline
    from models.checkpoint import quantize_experts_
    from models.config import K3Config
    from models.k3 import K3ForCausalLM

    if batch < 1 or tokens < 1:
        raise K3CError(f"--batch {batch} --tokens {tokens}: both must be >= 1")
    cfg = K3Config.from_pretrained(model)
    if cfg.hidden_size > 1024:
        raise K3CError(f"{model}: check interprets the model on random weights; use a tiny preset or small config")
    experts_dtype = experts_dtype or ("mxfp4" if cfg.expert_quantization == "mxfp4" else "bf16")
    if experts_dtype not in ("mxfp4", "bf16"):
        raise K3CError(f"--experts-dtype {experts_dtype}: expected mxfp4 or bf16")
    net = K3ForCausalLM(cfg).init_random_(seed)
    packed = quantize_experts_(net) if experts_dtype == "mxfp4" else {}   # the model an MXFP4 checkpoint loads
    graph = import_model(net, entry)
    weights = {k: p.detach() for k, p in net.named_parameters()} | packed
    bindings = {"B": batch, "T": tokens if entry == "prefill" else 1, "L": 5}
    t0 = time.perf_counter()
    check = make_numeric_check(bindings, seed, params=weights)
    ctx = CompileContext(max_batch=batch, max_seq=bindings["L"] + bindings["T"], max_prefill=bindings["T"],
                         experts_dtype=experts_dtype).for_entry(entry)
    _, report = run_pipeline(graph, ["cleanup", "model"], ctx=ctx, numeric_check=check)
    out.print(report.table())
    out.print(f"[green]every pass preserved the outputs of {cfg.name} ({entry}, {bindings})[/] "
              f"in {time.perf_counter() - t0:.1f} s")


INIT_MAX_BYTES = 4 * 2**30  # `k3c init` is for small models: a random full-size checkpoint is ~1e12 parameters


@app.command()
def init(preset: str = typer.Argument(..., help="a tiny preset (k3-tiny, k3.1-pro-tiny, kimi-linear-tiny) or config"),
         out_dir: Path = typer.Option(..., "-o", "--out", help="checkpoint directory to write (must not exist)"),
         seed: int = typer.Option(0, help="random seed (the same seed writes the same checkpoint)"),
         dtype: str = typer.Option("f32", help="f32 (runs on CPU) or bf16")):
    """Write a random checkpoint of PRESET in the published layout (config.json, sharded safetensors, index):
    the first step of `k3c init k3-tiny -o ck && k3c compile ck -o art && k3c run art`."""
    from models.config import K3Config

    if dtype not in ("f32", "bf16"):
        raise K3CError(f"--dtype {dtype}: expected f32 or bf16")
    if out_dir.exists():
        raise K3CError(f"-o {out_dir}: already exists; choose a new directory")
    cfg = K3Config.from_pretrained(preset)
    import torch

    from k3c.retarget import weights
    from models.checkpoint import save_random_checkpoint

    size = weights(cfg).params * (4 if dtype == "f32" else 2)
    if size > INIT_MAX_BYTES:
        raise K3CError(f"{preset}: a random {dtype} checkpoint would take {size / 2**30:,.0f} GiB (init writes at most "
                       f"{INIT_MAX_BYTES / 2**30:.0f} GiB); use a tiny preset, or `k3c compile {preset} --plan-only`, "
                       f"which needs no weights")

    with progress_bars() as progress:
        progress(f"writing {cfg.name}", 0, None)
        save_random_checkpoint(cfg, out_dir, seed=seed, dtype={"f32": torch.float32, "bf16": torch.bfloat16}[dtype])
    files = sorted(p.name for p in out_dir.iterdir())
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    out.print(f"wrote {out_dir}: {cfg.name}, {dtype}, seed {seed}; {len(files)} files, {size / 2**20:,.1f} MiB")


def _checkpoint_dtype(path: Path) -> str:
    """'f32' or 'bf16': the dtype of a checkpoint's embedding table (from the safetensors header, nothing loaded)."""
    import json

    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    shards = json.loads(index.read_text())["weight_map"] if index.is_file() else {
        k: f.name for f in sorted(path.glob("*.safetensors")) for k in safe_open(f, "numpy").keys()}
    key = next((k for k in sorted(shards) if k.endswith("embed_tokens.weight")), None)
    if key is None:
        raise K3CError(f"{path}: no embed_tokens.weight in the checkpoint; pass --dtype")
    with safe_open(path / shards[key], "numpy") as f:
        return "bf16" if f.get_slice(key).get_dtype() == "BF16" else "f32"


@app.command("compile")
def compile_cmd(model: str = typer.Argument(..., help="preset name, config.json or checkpoint directory"),
                out_dir: Path = typer.Option(..., "-o", "--out", help="artifact directory to write"),
                target: str = typer.Option("h200", help="target preset or target JSON file"),
                tp: int = typer.Option(1, help="tensor-parallel ranks (one artifact, weights/rank{r}.safetensors)"),
                ep: int = typer.Option(1, help="expert parallelism: 1 (experts split over their width) or --tp "
                                               "(experts partitioned over the ranks)"),
                max_batch: int = typer.Option(1), max_seq: int = typer.Option(4096),
                max_prefill: int = typer.Option(None, help="longest prefill call [default: min(1024, max-seq)]"),
                plan_only: bool = typer.Option(False, "--plan-only"),
                force: bool = typer.Option(False, "--force", help="replace an existing artifact"),
                dump: Path = typer.Option(None, help="write the IR after every pass here"),
                dtype: str = typer.Option("auto", help="activation and weight dtype: bf16, f32 or auto (the "
                                                       "checkpoint's: f32 or bf16; bf16 without weights)"),
                backend: str = typer.Option(None, help="preferred code generator (triton | tvm) [default: the "
                                                       "target's: triton on GPUs, tvm on CPUs]"),
                report: Path = typer.Option(None, help="also keep the report data in the artifact and write the "
                                                       "HTML report (`k3c report`) to this file"),
                allow_oversize: bool = typer.Option(False, "--allow-oversize", help="write an artifact that does not "
                                                    "fit the target's memory (for planning; see k3c/memory/budget.py)"),
                experts_dtype: str = typer.Option(None, "--experts-dtype",
                                                  help="routed experts: mxfp4 (the checkpoint's 4-bit bits) or bf16 "
                                                       "(dequantized, stored in --dtype) [default: as the checkpoint]"),
                all_logits: bool = typer.Option(False, "--all-logits", help="also compile prefill returning every "
                                                "position's logits (prefill(tokens, logits='all'))")):
    """Compile MODEL into an artifact: kernels, memory plan, schedule, weights, cost report."""
    from k3c.targets import load_target
    from models.config import K3Config

    # the cheap checks first: a wrong argument is reported before torch is imported
    K3Config.from_pretrained(model)
    load_target(target)
    if dtype not in ("auto", "bf16", "f32"):
        raise K3CError(f"--dtype {dtype}: expected auto, bf16 or f32")
    if dtype == "auto":
        dtype = _checkpoint_dtype(Path(model)) if Path(model).is_dir() and not plan_only else "bf16"
    if out_dir.exists() and not force:
        raise K3CError(f"{out_dir}: already exists (pass --force to replace it)")
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "manifest.json").is_file())):
        raise K3CError(f"{out_dir}: exists and is not a k3c artifact; --force only replaces artifacts")
    if report is not None and report.exists() and not force:
        raise K3CError(f"--report {report}: already exists (pass --force to overwrite it)")
    _compiling()
    from k3c.compile import CompileOptions, compile_model

    max_prefill = min(1024, max_seq) if max_prefill is None else max_prefill
    opts = CompileOptions(model, out_dir, target, tp, max_batch, max_seq, max_prefill, plan_only, force, dump, dtype,
                          backend, report=report is not None, ep=ep, allow_oversize=allow_oversize,
                          experts_dtype=experts_dtype, all_logits=all_logits)
    err.print("k3c compile " + " ".join(f"{k}={v}" for k, v in vars(opts).items()), highlight=False, soft_wrap=True)
    with progress_bars() as progress:
        s = compile_model(opts, progress=progress)
        if report is not None:
            progress("report", 0, None)
            from k3c.report.html import write

            write(out_dir, report)
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    out.print(f"wrote {out_dir}: {s['nodes']['prefill']} IR nodes, {s['kernels']} Triton kernels; weights "
              f"{mib(s['weights']['total'])} (routed experts {mib(s['weights']['experts'])}); "
              f"arena prefill {mib(s['arena']['prefill'])} "
              f"(lower bound {mib(s['lower_bound']['prefill'])}), decode {mib(s['arena']['decode'])}; pools "
              + ", ".join(f"{k} {mib(v)}" for k, v in s["pools"].items())
              + f"; roofline decode step {s['time']['decode'] * 1e3:.3f} ms; {s['seconds']:.1f} s"
              + (f"; report {report}" if report is not None else ""))
    if s["warning"]:
        err.print(f"[yellow]warning:[/] {s['warning']}", highlight=False, soft_wrap=True)
    if tp > 1:
        c = s["communication"]
        out.print(f"per rank and decode step at --max-batch {max_batch}: {mib(c['bytes'])} on the wire (plain "
                  f"all-reduces: {mib(c['plain_allreduce_bytes'])}); AttnRes state not duplicated: "
                  f"{mib(c['attn_res_state_bytes_not_duplicated'])}")


@app.command("report")
def report_cmd(artifact: Path = typer.Argument(..., help="artifact directory compiled with --report"),
               output: Path = typer.Option(..., "-o", "--output", help="HTML file to write"),
               force: bool = typer.Option(False, "--force", help="overwrite an existing -o file")):
    """Write the compile report of ARTIFACT as one self-contained HTML page: passes and per-pass IR diffs, kernels
    with their roofline, the memory timeline, per-layer and per-entry totals, the compile options."""
    if output.exists() and not force:
        raise K3CError(f"-o {output}: already exists (pass --force to overwrite it)")
    from k3c.report.html import write

    write(artifact, output)
    out.print(f"wrote {output} ({output.stat().st_size / 2**20:,.1f} MiB)")


DEFAULT_PROMPT = "1,2,3,4,5,6,7,8"


@app.command()
def run(artifact: Path = typer.Argument(..., help="artifact directory or .k3c file"),
        tokens: str = typer.Option(DEFAULT_PROMPT, help="prompt token ids, comma-separated"),
        decode_steps: int = typer.Option(8, help="greedy tokens to generate"),
        device: str = typer.Option("cpu", help="cpu (Triton kernels interpreted) or cuda"),
        cuda_graphs: bool = typer.Option(True, help="on cuda, replay decode steps as piecewise CUDA graphs")):
    """Run an artifact: prefill the prompt, then greedy decode; prints the tokens and timing. A multi-rank
    artifact (--tp N) runs as N processes: started here (gloo on cpu, NCCL on cuda), or by `torchrun`."""
    try:
        ids = [int(x) for x in tokens.split(",")]
    except ValueError:
        raise K3CError(f"--tokens {tokens!r}: expected comma-separated integers") from None
    bad = [x for x in ids if not 0 <= x < 2**63]
    if bad:
        raise K3CError(f"--tokens: {bad[0]} is not a token id (ids are integers >= 0)")
    if decode_steps < 1:
        raise K3CError(f"--decode-steps {decode_steps}: generate at least one token")
    tp = _artifact_tp(artifact)
    if tp > 1 and "WORLD_SIZE" not in os.environ:  # not under torchrun: start the ranks here
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory(prefix="k3c-run-") as tmp:
            try:
                mp.spawn(_rank_main, args=(tp, _free_port(), artifact, ids, decode_steps, device, cuda_graphs, tmp),
                         nprocs=tp, join=True)
            except mp.ProcessExitedException:  # a rank refused its input: rank 0 printed the one-line error
                raise typer.Exit(2) from None
            new, line = json.loads(Path(tmp, "rank0.json").read_text())
    else:
        with progress_bars() as progress:
            new, line = _generate(artifact, ids, decode_steps, device, cuda_graphs, progress)
    out.print(f"next tokens: {new}")
    err.print(line + (f"; {tp} ranks" if tp > 1 else ""))


def _artifact_tp(artifact: Path) -> int:
    from k3c.runtime.artifact import read_artifact

    return int(read_artifact(artifact).manifest.get("tp", 1))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, artifact, ids, decode_steps, device, cuda_graphs, tmp) -> None:
    """One rank spawned by `k3c run`: torchrun's environment, then the generation of a single-process run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    try:
        result = _generate(artifact, ids, decode_steps, device, cuda_graphs, lambda *a: None)
    except K3CError as e:  # one line from rank 0, as a single-process run prints it
        if rank == 0:
            err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    if rank == 0:
        Path(tmp, "rank0.json").write_text(json.dumps(result))


def _generate(artifact, ids, decode_steps, device, cuda_graphs, progress) -> tuple[list[int], str]:
    """Load, prefill `ids` chunk by chunk (showing progress on long prompts), greedy-decode; returns (the new
    tokens, a timing line)."""
    import torch

    from k3c.runtime.session import load

    progress("loading", 0, None)
    t0 = time.perf_counter()
    session = load(artifact, device, cuda_graphs=cuda_graphs)
    t_load = time.perf_counter() - t0
    if len(ids) + decode_steps - 1 > session.max_seq:
        raise K3CError(f"{len(ids)} prompt tokens + {decode_steps} generated exceed the compiled max_seq "
                       f"{session.max_seq} (the last generated token is not fed back)")
    prompt, t_prefill = torch.tensor([ids]), 0.0
    chunks = prompt.split(session.max_prefill, dim=1)
    for i, chunk in enumerate(chunks):
        progress("prefill chunks", i, len(chunks))
        logits = session.prefill(chunk)
        t_prefill += session.last_timing["seconds"]
    new, steps = [int(logits[0, -1].argmax())], []
    for i in range(decode_steps - 1):
        progress("decode", i, decode_steps - 1)
        logits = session.decode(torch.tensor([[new[-1]]]))
        steps.append(session.last_timing["seconds"])
        new.append(int(logits[0, -1].argmax()))
    per = f"{sum(steps) / len(steps) * 1e3:.1f} ms/step" if steps else "-"
    return new, f"load {t_load:.2f} s; prefill {len(ids)} tokens {t_prefill * 1e3:.1f} ms; decode {per} ({device})"


@app.command()
def finalize(artifact: Path = typer.Argument(..., help="artifact directory"),
             device: str = typer.Option("cuda", help="the CUDA device to compile for")):
    """Compile the artifact's Triton kernels for this GPU and Triton once and add them to it (loads then compile
    nothing; run on the machine that runs the artifact)."""
    from k3c.runtime.finalize import finalize as _finalize

    r = _finalize(artifact, device)
    if r["skipped"]:
        out.print(f"{artifact}: already holds the kernels for {r['tag']}")
    else:
        out.print(f"{artifact}: added {r['files']} files ({r['bytes'] / 2**20:.1f} MiB) of compiled kernels for "
                  f"{r['tag']} in {r['seconds']:.1f} s")


@app.command()
def plan(model: str = typer.Argument(..., help="preset name, config.json or checkpoint directory"),
         target: str = typer.Option("h200", help="target preset (h200, h100-sxm, b200, mi300x, ...) or a target JSON file"),
         tp: str = typer.Option("1,2,4,8,16", help="GPU count(s), comma-separated"),
         max_batch: int = typer.Option(1, help="sequences the caches are sized for (and the decode batch)"),
         max_seq: int = typer.Option(1 << 20, help="tokens per sequence the caches are sized for"),
         context: int = typer.Option(None, help="cached tokens for the decode estimate (default max-seq)"),
         experts_dtype: str = typer.Option(None, "--experts-dtype",
                                           help="routed experts stored as mxfp4 or bf16 [default: as the checkpoint]"),
         json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table")):
    """What MODEL needs on N GPUs of TARGET: memory per GPU and a decode-step roofline (no hardware needed)."""
    import json

    from k3c.retarget import estimate
    from models.config import K3Config

    try:
        tps = [int(x) for x in tp.split(",")]
    except ValueError:
        raise K3CError(f"--tp {tp!r}: expected comma-separated integers such as 8 or 1,2,4,8") from None
    cfg = K3Config.from_pretrained(model)
    rows = [estimate(cfg, target, n, max_batch, max_seq, context, experts_dtype=experts_dtype) for n in tps]
    if json_out:
        out.print_json(json.dumps([r.to_json() for r in rows]))
        return
    e0 = rows[0]
    t = Table(title=f"{cfg.name} on {e0.target}: {e0.params / 1e9:,.1f} billion parameters ({e0.active_params_per_token / 1e9:.1f} "
                    f"billion active); caches for {max_batch} x {max_seq:,} tokens")
    for col in ("GPUs", "weights/GPU", "caches/GPU", "total/GPU", "fits", "decode step", "bound", "tokens/s"):
        t.add_column(col, justify="right")
    gib = lambda b: f"{b / 2**30:,.1f} GiB"  # noqa: E731
    for r in rows:
        t.add_row(str(r.tp), gib(r.weight_bytes_per_gpu), gib(r.pool_bytes_per_gpu),
                  gib(r.weight_bytes_per_gpu + r.pool_bytes_per_gpu), "[green]yes[/]" if r.fits else "[red]no[/]",
                  f"{r.decode_step_s * 1e3:.2f} ms", r.decode_bound, f"{r.decode_tokens_per_s:,.0f}")
    t.caption = (f"memory per GPU {gib(e0.memory_bytes)}; at least {e0.min_gpus} GPUs needed; decode at batch "
                 f"{e0.decode_batch}, context {e0.decode_context:,}: roofline with measured bandwidth/peak (k3c/retarget.py)")
    out.print(t)


def _version(value: bool) -> None:
    if value:
        out.print(f"k3c {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print the version and exit")) -> None:
    """k3c: ahead-of-time compiler for the Kimi K3 family."""


def main() -> None:
    """Entry point: run the app, printing K3CError (and an OSError on a path the user gave) as one line, exit 2."""
    gc_was_on = gc.isenabled()
    try:
        app()
    except K3CError as e:
        err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except OSError as e:  # a path the user named (-o, --dump) that cannot be written or read
        where = f"{e.filename}: " if e.filename else ""
        err.print(f"[red]error:[/] {where}{e.strerror or e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    finally:
        if gc_was_on:  # a command may pause it (`_compiling`); a caller running main() in process gets it back
            gc.enable()


if __name__ == "__main__":
    main()
