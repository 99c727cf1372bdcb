"""CPU speed of a k3c artifact (TVM kernels, `--target cpu-x86-64`) against torch eager and torch.compile.

A mid-size K3 (hidden 1024, 8 layers: 6 KDA + 2 MLA, 32 experts choose 4, vocab 32K; random fp32 weights) is
compiled for the CPU; all three run fp32 on the same checkpoint:
- decode: one step at batch 1 and at batch 4 after a 64-token prompt (median of the timed steps);
- prefill: one 256-token prompt at batch 1.

    PYTHONPATH=$PWD python benchmarks/bench_cpu.py [--steps 8] [--out build/bench_cpu.json] [--small]
        [--runtimes k3c,eager,compile] [--profile]

`--small` runs a quarter-width config instead (hidden 256, 4 layers, 8 experts, vocab 4K): a check of the script.
`--runtimes` picks the runtimes (torch.compile takes minutes); `--profile` adds where k3c's decode step at batch 1
goes: seconds per step by (backend, kind) of its launches, each launch timed from Python (what the launcher does
around the kernel included).

The bandwidth floor of a decode step: the bytes it must read from memory (`decode_bytes`: every weight it uses
once, the routed experts the batch picks, the KDA states read and written) over the machine's read bandwidth
(`read_gbps`, a torch sum over 512 MB). Each runtime's row says what fraction of that floor it reaches.

Prints a markdown table (BENCHMARKS.md "CPU") and writes the numbers as JSON. Threads: torch and the k3c kernels
use every core (torch.get_num_threads(); K3C_NUM_THREADS for the k3c kernel pool).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import k3c
from k3c.compile import CompileOptions, compile_model
from models.checkpoint import save_random_checkpoint
from models.config import _shrink

PROMPT, PREFILL = 64, 256
RUNTIMES = {"k3c": "k3c (TVM, cpu-x86-64)", "eager": "torch eager", "compile": "torch.compile"}


def mid_config():
    """hidden 1024, 8 layers (KDA 1-3, 5-7; MLA 4, 8), 8 KDA heads of 128, 32 experts choose 4 of width 256."""
    return _shrink("k3-mid", "k3", vocab_size=32000, hidden_size=1024, num_hidden_layers=8, intermediate_size=2816,
                   num_experts=32, num_experts_per_token=4, moe_intermediate_size=256, num_attention_heads=8,
                   kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, q_lora_rank=384,
                   routed_expert_hidden_size=256, attn_res_block_size=4, num_shared_experts=1,
                   linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=8,
                                           head_dim=128))


def small_config():
    """A quarter-width stand-in of `mid_config` (hidden 256, 4 layers, 8 experts, vocab 4K) to check the script."""
    return _shrink("k3-small", "k3", vocab_size=4096, hidden_size=256, num_hidden_layers=4, intermediate_size=704,
                   num_experts=8, num_experts_per_token=2, moe_intermediate_size=64, num_attention_heads=4,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=96,
                   routed_expert_hidden_size=64, attn_res_block_size=2, num_shared_experts=1,
                   linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2, 4], num_heads=4, head_dim=64))


def _median_step(step, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_gbps(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """The machine's read bandwidth in GB/s: the best of `reps` torch sums over an fp32 tensor of `nbytes`."""
    x = torch.ones(nbytes // 4)
    best = min(_median_step(lambda: x.sum(), 1) for _ in range(reps))
    return nbytes / best / 1e9


def decode_bytes(model, batch: int) -> dict:
    """Bytes one decode step at `batch` must read: every weight but the token embedding (it reads `batch` rows of
    it) and the routed experts, of which it reads the expected number of distinct experts its tokens pick
    (E·(1 − (1 − k/E)^batch), k of E chosen uniformly), plus the KDA recurrent states, read and written
    ([batch, heads, 128, 128] fp32 per KDA layer). {"weights", "experts", "states", "total"} in bytes."""
    c = model.config
    E, k = c.num_experts, c.num_experts_per_token
    picked = E * (1 - (1 - k / E) ** batch) / E
    dense = experts = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            dense += batch * p.shape[1] * p.element_size()
        elif ".experts.w" in name:
            experts += n * picked
        else:
            dense += n
    states = 2 * len(c.kda_layers) * batch * c.kda_num_heads * c.kda_head_dim ** 2 * 4
    return {"weights": dense, "experts": int(experts), "states": states, "total": int(dense + experts + states)}


def profile_decode(session, batch: int, steps: int) -> dict:
    """Seconds per decode step at `batch` by "backend kind" of the launches, each timed around its launcher's
    `launch` (the step's launches counted under "launches")."""
    acc: dict[str, float] = {}
    count = 0

    def timed(launcher):
        inner = launcher.launch

        def launch(frame, ln):
            nonlocal count
            t0 = time.perf_counter()
            inner(frame, ln)
            key = f"{ln['backend']} {ln['kind']}"
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
            count += 1
        return launch

    session.reset()
    tokens = torch.randint(0, session.vocab, (batch, PROMPT))
    session.prefill(tokens)
    for _ in range(2):
        session.decode(tokens[:, -1:])
    for launcher in session.launchers.values():
        launcher.launch = timed(launcher)
    try:
        for _ in range(steps):
            session.decode(tokens[:, -1:])
    finally:
        for launcher in session.launchers.values():
            del launcher.launch
    out = {k: v / steps for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    out["launches"] = count / steps
    return out


def bench_eager(model, steps: int, compiled: bool) -> dict:
    fn = torch.compile(model, dynamic=True) if compiled else model
    out = {}
    with torch.no_grad():
        for batch in (1, 4):
            tokens = torch.randint(0, model.config.vocab_size, (batch, PROMPT))
            _, cache = fn(tokens)
            nxt = tokens[:, -1:]
            for _ in range(2):  # warm-up (compilation for torch.compile)
                _, cache = fn(nxt, cache)

            def step():
                nonlocal cache
                _, cache = fn(nxt, cache)

            out[f"decode_b{batch}_s"] = _median_step(step, steps)
        tokens = torch.randint(0, model.config.vocab_size, (1, PREFILL))
        fn(tokens)
        out["prefill_s"] = _median_step(lambda: fn(tokens), 3)
    return out


def bench_k3c(path: Path, steps: int, profile: bool = False) -> dict:
    session = k3c.load(path, "cpu")
    out = {"profile_decode_b1_s": profile_decode(session, 1, steps)} if profile else {}
    for batch in (1, 4):
        session.reset()
        tokens = torch.randint(0, session.vocab, (batch, PROMPT))
        session.prefill(tokens)
        nxt = tokens[:, -1:]
        for _ in range(2):
            session.decode(nxt)
        out[f"decode_b{batch}_s"] = _median_step(lambda: session.decode(nxt), steps)
    tokens = torch.randint(0, session.vocab, (1, PREFILL))

    def prefill():
        session.reset()
        session.prefill(tokens)

    prefill()
    out["prefill_s"] = _median_step(prefill, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("build/bench_cpu.json"))
    ap.add_argument("--small", action="store_true", help="the quarter-width config (checks the script, minutes less)")
    ap.add_argument("--runtimes", default="k3c,eager,compile", help="comma-separated, of k3c, eager, compile")
    ap.add_argument("--profile", action="store_true", help="k3c's decode step at batch 1 by launch kind")
    args = ap.parse_args()
    picked = args.runtimes.split(",")
    if not picked or set(picked) - set(RUNTIMES):
        ap.error(f"--runtimes: a comma-separated subset of {', '.join(RUNTIMES)}, not {args.runtimes!r}")
    cfg = small_config() if args.small else mid_config()
    phases = {}
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="k3c-bench-") as tmp:
        root = Path(tmp)
        model = save_random_checkpoint(cfg, root / "ckpt", seed=0, dtype=torch.float32).eval()
        t0 = time.perf_counter()
        # in a child process: this one runs the artifact as a deployment does, with the runtime only (importing
        # `tvm` here would let its runtime replace the kernel library's thread pool with TVM's own)
        child = multiprocessing.get_context("spawn").Process(target=compile_model, args=(CompileOptions(
            str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=4, max_seq=PREFILL + 64,
            max_prefill=PREFILL, dtype="f32", backend="tvm"),))
        child.start()
        child.join()
        if child.exitcode != 0:
            sys.exit(f"k3c compile failed (exit code {child.exitcode})")
        compile_s = time.perf_counter() - t0
        print(f"k3c compile: {compile_s:.0f} s", file=sys.stderr, flush=True)
        rows = {}
        runs = {"k3c": lambda: bench_k3c(root / "art", args.steps, args.profile),
                "eager": lambda: bench_eager(model, args.steps, compiled=False),
                "compile": lambda: bench_eager(model, args.steps, compiled=True)}
        for key in picked:
            name, run = RUNTIMES[key], runs[key]
            t0 = time.perf_counter()
            rows[name] = run()
            phases[name] = time.perf_counter() - t0
            print(f"{name}: {phases[name]:.0f} s", file=sys.stderr, flush=True)
    c = cfg
    gbps = read_gbps()
    need = {b: decode_bytes(model, b) for b in (1, 4)}
    floor = {b: need[b]["total"] / gbps / 1e9 for b in (1, 4)}
    result = {"config": f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_experts} experts top-"
                        f"{c.num_experts_per_token}, vocab {c.vocab_size}, fp32",
              "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
              "tvm_imported": "tvm" in sys.modules, "read_gbps": gbps,
              "decode_bytes": {f"b{b}": v for b, v in need.items()},
              "decode_floor_s": {f"b{b}": v for b, v in floor.items()},
              "k3c_compile_s": compile_s, "phase_s": phases, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"| {'runtime':24} | decode B=1 (ms) | of floor | decode B=4 (ms) | of floor | prefill 256 (ms) |")
    print(f"| {'-' * 24} | --------------- | -------- | --------------- | -------- | ---------------- |")
    print(f"| {'bandwidth floor':24} | {floor[1] * 1e3:15.1f} | {1:8.2f} | {floor[4] * 1e3:15.1f} | {1:8.2f} | "
          f"{'':16} |")
    for name, r in rows.items():
        print(f"| {name:24} | {r['decode_b1_s'] * 1e3:15.1f} | {floor[1] / r['decode_b1_s']:8.2f} | "
              f"{r['decode_b4_s'] * 1e3:15.1f} | {floor[4] / r['decode_b4_s']:8.2f} | {r['prefill_s'] * 1e3:16.1f} |")
    for name, r in rows.items():
        print(f"{name}: decode " + ", ".join(
            f"B={b} " + ", ".join(f"{rows[o][f'decode_b{b}_s'] / r[f'decode_b{b}_s']:.2f}x {o}" for o in rows
                                   if o != name) for b in (1, 4)))
    if args.profile:
        prof = rows[RUNTIMES["k3c"]]["profile_decode_b1_s"]
        print(f"k3c decode B=1 by launch kind ({prof['launches']:.0f} launches): " +
              ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in prof.items() if k != "launches"))
    print(f"{result['config']}; decode B=1 reads {need[1]['total'] / 1e6:.0f} MB, B=4 {need[4]['total'] / 1e6:.0f} MB "
          f"at {gbps:.1f} GB/s; k3c compile: {compile_s:.0f} s; time per runtime (s): "
          f"{', '.join(f'{k} {v:.0f}' for k, v in phases.items())}; torch threads: {torch.get_num_threads()}; "
          f"load average {' '.join(f'{x:.2f}' for x in result['load_average'])}")


if __name__ == "__main__":
    main()
