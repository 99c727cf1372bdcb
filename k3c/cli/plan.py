"""`k3c plan`: what a model needs on N GPUs of a target (memory per GPU, a decode-step roofline); no hardware."""

from __future__ import annotations

import typer
from rich.table import Table

from k3c.cli.app import app, out
from k3c.errors import K3CError

@app.command()
def plan(model: str = typer.Argument(..., help="preset name, config.json or checkpoint directory"),
         target: str = typer.Option("h200", help="target preset (h200, h100-sxm, b200, mi300x, ...) or a target JSON file"),
         tp: str = typer.Option(None, help="GPU count(s), comma-separated [default: those of 1,2,4,8,16 that "
                                           "split the model; 1 for a target without an interconnect, such as a CPU]"),
         max_batch: int = typer.Option(1, help="sequences the caches are sized for (and the decode batch)"),
         max_seq: int = typer.Option(1 << 20, help="tokens per sequence the caches are sized for"),
         context: int = typer.Option(None, help="cached tokens for the decode estimate (default max-seq)"),
         experts_dtype: str = typer.Option(None, "--experts-dtype",
                                           help="routed experts stored as mxfp4 or bf16 [default: as the checkpoint]"),
         kda_state: str = typer.Option("f32", "--kda-state", help="KDA recurrent state stored as f32 or bf16"),
         dsa_index_keys: str = typer.Option(None, "--dsa-index-keys", help="DSA index keys stored as fp8 (e4m3 + "
                                            "one f32 scale per key, as K3-SPEC sizes them), fp8-rerank (+ a 4-bit "
                                            "residual per element: exact re-rank of the top candidates) or bf16 "
                                            "[default: fp8 for a model with DSA layers]"),
         json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table")):
    """What MODEL needs on N GPUs of TARGET: memory per GPU and a decode-step roofline (no hardware needed)."""
    import json

    from k3c.retarget import estimate, splits
    from k3c.targets import load_target
    from models.config import K3Config

    if experts_dtype not in (None, "mxfp4", "bf16"):      # worded as `k3c compile` and `k3c check` word it
        raise K3CError(f"--experts-dtype {experts_dtype}: expected mxfp4 or bf16")
    try:
        tps = [int(x) for x in tp.split(",")] if tp is not None else None
    except ValueError:
        raise K3CError(f"--tp {tp!r}: expected comma-separated integers such as 8 or 1,2,4,8") from None
    cfg = K3Config.from_pretrained(model)
    if tps is None:         # the default counts that split this model (`check_layout`), as `estimate` splits it
        tps = [n for n in ((1, 2, 4, 8, 16) if load_target(target).interconnect_bandwidth else (1,))
               if splits(cfg, n, (n,))]
    rows = [estimate(cfg, target, n, max_batch, max_seq, context, experts_dtype=experts_dtype,
                     kda_state_dtype=kda_state, dsa_index_keys=dsa_index_keys) for n in tps]
    if json_out:
        out.print_json(json.dumps([r.to_json() for r in rows]))
        return
    e0 = rows[0]
    t = Table(title=f"{cfg.name} on {e0.target}: {e0.params / 1e9:,.1f} billion parameters ({e0.active_params_per_token / 1e9:.1f} "
                    f"billion active); caches for {max_batch} x {max_seq:,} tokens, "
                    f"KDA state {kda_state}"
                    + (f", DSA index keys {dsa_index_keys or 'fp8'}" if cfg.dsa_layers else ""))
    unit = "device" if load_target(target).kind == "cpu" else "GPU"
    for col in (f"{unit}s", f"weights/{unit}", f"caches/{unit}", f"total/{unit}", "fits", "decode step", "bound",
                "tokens/s"):
        t.add_column(col, justify="right")
    gib = lambda b: f"{b / 2**30:,.1f} GiB"  # noqa: E731
    for r in rows:
        t.add_row(str(r.tp), gib(r.weight_bytes_per_gpu), gib(r.pool_bytes_per_gpu),
                  gib(r.weight_bytes_per_gpu + r.pool_bytes_per_gpu), "[green]yes[/]" if r.fits else "[red]no[/]",
                  f"{r.decode_step_s * 1e3:.2f} ms", r.decode_bound, f"{r.decode_tokens_per_s:,.0f}")
    if e0.min_gpus is None:
        need = f"no {unit} count holds it: the caches alone need {gib(e0.pool_bytes_per_gpu)} per {unit} at tp {e0.tp}"
    else:
        need = f"at least {e0.min_gpus} {unit}{'s' * (e0.min_gpus != 1)} needed" + (
            "" if e0.min_tp == e0.min_gpus else f" (the fewest --tp from there: {e0.min_tp})" if e0.min_tp else
            f" (no --tp of {e0.min_gpus} or more splits {cfg.name})")
    t.caption = (f"memory per {unit} {gib(e0.memory_bytes)}; {need}; decode at batch "
                 f"{e0.decode_batch}, context {e0.decode_context:,}: roofline with measured bandwidth/peak (k3c/retarget.py)")
    out.print(t)

