"""`k3c init`, `k3c compile` and `k3c report`: a random checkpoint, an artifact from a model, and the HTML
compile report of an artifact."""

from __future__ import annotations

from pathlib import Path

import typer

from k3c.cli.app import app, check_dump_dir, check_writable, compiling, err, out, progress_bars
from k3c.errors import CheckpointError, K3CError

INIT_MAX_BYTES = 4 * 2**30  # `k3c init` is for small models: a random full-size checkpoint is ~1e12 parameters


@app.command()
def init(preset: str = typer.Argument(..., help="a tiny preset (k3-tiny, k3.1-pro-tiny, kimi-linear-tiny) or config"),
         out_dir: Path = typer.Option(..., "-o", "--out", help="checkpoint directory to write (must not exist)"),
         seed: int = typer.Option(0, help="random seed, 0 .. 2^64 - 1 (the same seed writes the same checkpoint)"),
         dtype: str = typer.Option("f32", help="f32 (runs on CPU) or bf16"),
         experts_dtype: str = typer.Option(None, "--experts-dtype",
                                           help="routed experts: mxfp4 (compressed-tensors MXFP4, as the published "
                                                "K3 checkpoints store them) or bf16 (dense, stored in --dtype) "
                                                "[default: as PRESET's config]")):
    """Write a random checkpoint of PRESET in the published layout (config.json, sharded safetensors, index):
    the first step of `k3c init k3-tiny -o ck && k3c compile ck -o art && k3c run art`."""
    from models.config import K3Config

    if dtype not in ("f32", "bf16"):
        raise K3CError(f"--dtype {dtype}: expected f32 or bf16")
    if experts_dtype not in (None, "mxfp4", "bf16"):
        raise K3CError(f"--experts-dtype {experts_dtype}: expected mxfp4 or bf16")
    if not 0 <= seed < 2 ** 64:      # torch's generator takes 64 bits: others would alias a seed in range
        raise K3CError(f"--seed {seed}: expected 0 .. 2^64 - 1")
    check_writable(out_dir, "-o")
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
        fmt = {None: None, "mxfp4": "mxfp4", "bf16": "dense"}[experts_dtype]
        torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        model = save_random_checkpoint(cfg, out_dir, seed=seed, dtype=torch_dtype, expert_format=fmt)
    files = sorted(p.name for p in out_dir.iterdir())
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    experts = "MXFP4" if model.config.expert_quantization == "mxfp4" else dtype
    out.print(f"wrote {out_dir}: {cfg.name}, {dtype}, {experts} experts, seed {seed}; {len(files)} files, "
              f"{size / 2**20:,.1f} MiB", soft_wrap=True)


def _checkpoint_dtype(path: Path) -> str:
    """'f32' or 'bf16': the dtype of a checkpoint's embedding table (from the safetensors header, nothing loaded).
    Raises CheckpointError for an unreadable index or shard (naming it), K3CError without an embedding table."""
    from models.checkpoint import index_weight_map, open_shard

    shards = index_weight_map(path)
    if shards is None:
        shards = {}
        for f in sorted(path.glob("*.safetensors")):
            with open_shard(f) as st:
                shards.update(dict.fromkeys(st.keys(), f.name))
    key = next((k for k in sorted(shards) if k.endswith("embed_tokens.weight")), None)
    if key is None:
        raise K3CError(f"{path}: no embed_tokens.weight in the checkpoint; pass --dtype")
    shard = path / shards[key]
    if not shard.is_file():
        raise CheckpointError(f"{path}: shard {shards[key]} (holding {key} by the index) is missing")
    with open_shard(shard) as f:
        if key not in f.keys():
            raise CheckpointError(f"{path / 'model.safetensors.index.json'}: weight_map puts {key} in {shards[key]}, "
                                  "which does not hold it")
        return "bf16" if f.get_slice(key).get_dtype() == "BF16" else "f32"


def _rounded_tensors(path: Path, dtype: str) -> list[str]:
    """The keys of a checkpoint's tensors that an artifact in `dtype` ('bf16' or 'f32') would round: stored as a
    wider float (f32 or f64 for bf16, f64 for f32), other than the parameters the model keeps in f32
    (models.layers.FP32_PARAM_SUFFIXES) and keys the model does not read; sorted. Reads the safetensors headers
    only. Raises CheckpointError for an unreadable shard, ConfigError for a bad config.json."""
    from models.checkpoint import expected_tensors, open_shard
    from models.config import K3Config
    from models.layers import FP32_PARAM_SUFFIXES

    wider = {"bf16": ("F32", "F64"), "f32": ("F64",)}[dtype]
    expected = expected_tensors(K3Config.from_pretrained(path))
    keys = []
    for shard in sorted(path.glob("*.safetensors")):
        with open_shard(shard) as f:
            keys += [k for k in f.keys() if k in expected and not k.endswith(FP32_PARAM_SUFFIXES)
                     and f.get_slice(k).get_dtype() in wider]
    return sorted(keys)


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
                                                "position's logits (prefill(tokens, logits='all'))"),
                kda_state: str = typer.Option("f32", "--kda-state", help="storage of the KDA recurrent state: f32 or "
                                              "bf16 (half the pool bytes; computed in f32, rounded once per call; "
                                              "Triton backend only)"),
                dsa_index_keys: str = typer.Option("bf16", "--dsa-index-keys", help="storage of the DSA indexer's "
                                                   "key cache: bf16, fp8 (e4m3 + one f32 scale per key: 132 "
                                                   "instead of 256 B per token) or fp8-rerank (+ a 4-bit residual "
                                                   "per element, 196 B: the scan reads 132, the top candidates are "
                                                   "re-ranked exactly); fp8 options: Triton backend only")):
    """Compile MODEL into an artifact: kernels, memory plan, schedule, weights, cost report."""
    from k3c.context import check_dsa_index_keys, check_kda_state
    from k3c.targets import load_target
    from models.config import K3Config

    # the cheap checks first: a wrong argument is reported before torch is imported
    K3Config.from_pretrained(model)
    load_target(target)
    check_kda_state(kda_state)
    check_dsa_index_keys(dsa_index_keys)
    if dtype not in ("auto", "bf16", "f32"):
        raise K3CError(f"--dtype {dtype}: expected auto, bf16 or f32")
    if max_seq < 1:         # before --max-prefill's default follows it, so the error names the flag given
        raise K3CError(f"--max-seq {max_seq}: expected at least 1")
    if dtype == "auto":
        dtype = _checkpoint_dtype(Path(model)) if Path(model).is_dir() and not plan_only else "bf16"
        rounded = _rounded_tensors(Path(model), dtype) if Path(model).is_dir() and not plan_only else []
        if rounded:     # a mixed checkpoint: say what the artifact does not keep exactly
            more = f" and {len(rounded) - 1} more" if len(rounded) > 1 else ""
            err.print(f"[yellow]warning:[/] {model}: {rounded[0]}{more} stored wider than {dtype}, the dtype of its "
                      f"embedding table, and rounded to it in the artifact; "
                      + ("pass --dtype f32 to keep them exact" if dtype == "bf16" else "k3c stores at most f32"),
                      highlight=False, soft_wrap=True)
    check_writable(out_dir, "-o")
    if report is not None and report.resolve().is_relative_to(out_dir.resolve()):
        raise K3CError(f"--report {report}: inside the artifact {out_dir}, whose files are all listed in its "
                       "manifest; write the page beside it")
    if out_dir.exists() and not force:
        raise K3CError(f"{out_dir}: already exists (pass --force to replace it)")
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "manifest.json").is_file())):
        raise K3CError(f"{out_dir}: exists and is not a k3c artifact; --force only replaces artifacts")
    check_dump_dir(dump)
    if report is not None:
        check_writable(report, "--report", file=True)
    if report is not None and report.exists() and not force:
        raise K3CError(f"--report {report}: already exists (pass --force to overwrite it)")
    compiling()
    from k3c.compile import CompileOptions, compile_model

    max_prefill = min(1024, max_seq) if max_prefill is None else max_prefill
    opts = CompileOptions(model, out_dir, target, tp, max_batch, max_seq, max_prefill, plan_only, force, dump, dtype,
                          backend, report=report is not None, ep=ep, allow_oversize=allow_oversize,
                          experts_dtype=experts_dtype, all_logits=all_logits, kda_state_dtype=kda_state,
                          dsa_index_keys=dsa_index_keys)
    with progress_bars() as progress:
        s = compile_model(opts, progress=progress)
        if report is not None:
            progress("report", 0, None)
            from k3c.report.html import write

            try:
                write(out_dir, report)
            except K3CError as e:       # the artifact is in place: say so, and how to get the page later
                raise K3CError(f"{e} (the artifact {out_dir} is written; `k3c report {out_dir} -o FILE` writes "
                               "its page)") from None
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    kinds = "/".join(s["kernel_backends"]) or "generated"  # plan-only: none
    out.print(f"wrote {out_dir}: {s['nodes']['prefill']} IR nodes, {s['kernels']} {kinds} kernels; weights "
              f"{mib(s['weights']['total'])} (routed experts {mib(s['weights']['experts'])}); "
              f"arena prefill {mib(s['arena']['prefill'])} "
              f"(lower bound {mib(s['lower_bound']['prefill'])}), decode {mib(s['arena']['decode'])}; pools "
              + ", ".join(f"{k} {mib(v)}" for k, v in s["pools"].items())
              + f"; roofline decode step {s['time']['decode'] * 1e3:.3f} ms; {s['seconds']:.1f} s"
              + (f"; report {report}" if report is not None else ""), soft_wrap=True)
    if s["warning"]:
        err.print(f"[yellow]warning:[/] {s['warning']}", highlight=False, soft_wrap=True)
    if tp > 1:
        c = s["communication"]
        out.print(f"per rank and decode step at --max-batch {max_batch}: {mib(c['bytes'])} on the wire (plain "
                  f"all-reduces: {mib(c['plain_allreduce_bytes'])}); AttnRes state not duplicated: "
                  f"{mib(c['attn_res_state_bytes_not_duplicated'])}", soft_wrap=True)


@app.command("report")
def report_cmd(artifact: Path = typer.Argument(..., help="artifact directory compiled with --report"),
               output: Path = typer.Option(..., "-o", "--output", help="HTML file to write"),
               force: bool = typer.Option(False, "--force", help="overwrite an existing -o file")):
    """Write the compile report of ARTIFACT as one self-contained HTML page: passes and per-pass IR diffs, kernels
    with their roofline, the memory timeline, per-layer and per-entry totals, the compile options."""
    check_writable(output, "-o", file=True)
    if output.exists() and not force:
        raise K3CError(f"-o {output}: already exists (pass --force to overwrite it)")
    from k3c.report.html import write

    write(artifact, output)
    out.print(f"wrote {output} ({output.stat().st_size / 2**20:,.1f} MiB)", soft_wrap=True)
