"""End-to-end GPU benchmark: k3c against eager PyTorch on a full-width, reduced-depth Kimi K3.1 Pro, one run.

The model (`bench_config`): K3.1 Pro's published widths (hidden 7168, vocab 163840, 96 KDA heads of 128, gated DSA
with a 32-head indexer choosing 2048 keys, LatentMoE experts of 3584 -> 3072) at 4 layers (3 KDA + 1 DSA, layer 0 a
dense MLP) with 32 routed experts choosing 16, bf16, dense experts (`--experts mxfp4`: MXFP4 experts as the published
checkpoints store them, kept 4-bit in the artifact); random weights drawn on the GPU and written as a checkpoint in
the published layout (`save_random_checkpoint`), compiled by k3c for the H200, then:

1. `finalize`: the Triton kernels compiled on this GPU once and stored in the artifact (`k3c.runtime.finalize`);
2. first logits after load: a fresh process with an empty Triton cache loads the artifact and prefills a prompt;
   load (files hash-checked, weights copied, kernel code loaded: `Session.load_seconds`), first and second prefill,
   the first prefill's costliest functions (cProfile) and whether any kernel was compiled (none should);
3. decode at batch 1 / 16 / 64 and context 4K / 128K: k3c (one CUDA graph per step), eager and torch.compile
   (`dynamic=True`, batch 1 and 16 at 4K), median step time, against the
   HBM floor: the bytes a step must read (`floor_bytes`: every weight the step touches, routed experts at the
   expected share a batch touches under uniform routing, KDA / conv states read and written, the DSA index keys
   and the selected latent-KV rows) at 4.2 TB/s (the H200's achievable HBM read rate; the copy rate measured here
   is reported beside it). Contexts are set, not prefilled: the attention caches hold random values
   (`random_caches`; the DSA selection's work depends on the scores: a zeroed cache ties every key); the
   timed steps are a decode loop from that context (L .. L + 20), each a `Session.decode` call (the token check,
   one graph replay, the logits copy) synchronised; beside it the graph alone (`graph_ms`: replays back to back)
   and the GPU timeline of one step (`timeline`: time in kernels and the gaps between them), and the step of a
   greedy generation loop (`Session.generate`: each step's argmax taken in its graph, no host sync between steps;
   the time of 21 generated tokens less that of 1, over 20);
4. prefill of 2560-token prompts at batch 1 and 16 (tokens/s, TFLOP/s of the model's matmuls) and the GEMM rate of
   the prefill against a plain bf16 matmul measured here; eager prefills in chunks of max_prefill tokens as k3c
   does (measured before k3c loads);
5. a per-kernel-kind breakdown (torch.profiler) of a decode step (batch 1 and 16, context 4K and 128K: the mean of
   `DECODE_PROFILE_CALLS` steps, kernels launched one by one) and of one prefill call; from the batch-1 and -16
   steps at 4K, the rate the expert kernels read the routed experts' bytes (`expert_read_tbps`);
6. numerics: k3c bf16 vs eager bf16, in the band of eager bf16 vs eager fp32 (same checkpoint), over a prefill and
   64 teacher-forced decode steps of 4 prompts, 260 positions (max and the distribution over positions: a random
   router's near-ties flip a top-k choice at some positions of any bf16 run, and which ones differs between runs;
   run G and earlier: one prompt, 65 positions); and per layer (input norm, mixer output after o_proj, MLP / MoE
   output) over the prefill, to see where a difference arises, and
   per MoE layer the share of tokens whose chosen experts differ from eager fp32's (k3c and eager bf16);
7. batch 4 x 32K context prefilled in 8K chunks (a second artifact, `--max-batch 4 --max-prefill 8192`, loaded
   after the first session is released), its peak memory against the plan (arena + pools + weights).
Phases write OUT/bench_e2e.json (`--experts mxfp4`: OUT/bench_e2e_mxfp4.json) as they finish (a run cut short keeps
what it measured).

Usage (on the H200, through the device tool): python benchmarks/bench_e2e.py --out $OUT [--work /dev/shm/k3c-bench]
[--experts mxfp4]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from e2e_measure import (FIRST_LOGITS, HBM_BPS, EagerDecode, decode_tokens, eager_prefill, floor_bytes,  # noqa: E402
                         graph_ms, launch_transients, layer_errors, load_second, matmul_flops_per_token,
                         profile, route_disagreement, route_sets_differ, routes_recorded, timed, timeline)

PROMPT = 2560
DECODE_PROFILE_CALLS = 10     # decode steps a breakdown averages (`profile`)
NUMERICS_STEPS, NUMERICS_BATCH = 64, 4  # teacher-forced decode steps of NUMERICS_BATCH prompts (numerics phase)


def bench_config():
    """K3.1 Pro at full width, 4 layers (3 KDA + 1 DSA, layer 0 dense), 32 routed experts choosing 16."""
    from models.config import K3Config

    raw = json.loads((Path(__file__).parents[1] / "models/configs/kimi-k3.1-pro.json").read_text())
    t = raw["text_config"]
    t.pop("quantization_config", None)
    t.update(num_hidden_layers=4, num_experts=32, num_experts_per_token=16, first_k_dense_replace=1)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4])
    t["dsa_config"]["dsa_layers"] = [4]
    return K3Config.from_dict(raw, source="bench_e2e", name="k3.1-pro-4L-32E")


def random_caches(session) -> None:
    """Fill the attention cache pools (latent KV, DSA index keys) with N(0, 1) values, as a prefilled context holds
    distinct keys. The DSA radix select's work depends on the scores: a zeroed cache gives every key the same score,
    its worst case (one candidate list of every key, BENCHMARKS.md "DSA decode"). The KDA states stay zero (their
    contents do not change a step's work)."""
    for name, pool in session.pools.items():
        if name.endswith((".kv", ".index_k")) and pool.is_floating_point():
            pool.normal_()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/k3c-bench"))
    ap.add_argument("--max-seq", type=int, default=131072 + 1024)
    ap.add_argument("--max-prefill", type=int, default=640)
    ap.add_argument("--experts", choices=("dense", "mxfp4"), default="dense",
                    help="routed experts of the checkpoint: bf16 (dense) or MXFP4 (the published layout, kept 4-bit "
                         "in the artifact); mxfp4 writes OUT/bench_e2e_mxfp4.json")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: finalize, first_logits, long, "
                                               "eager, torch_compile, numerics, bf16_build (mxfp4 only)")
    ap.add_argument("--kda-state", choices=("f32", "bf16"), default="f32",
                    help="storage of the KDA recurrent state (k3c compile --kda-state; the HBM floor counts it)")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    out_name = "bench_e2e.json" if a.experts == "dense" else "bench_e2e_mxfp4.json"
    import k3c
    from k3c.compile import CompileOptions, compile_model
    from models.checkpoint import save_random_checkpoint

    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": __import__("triton").__version__, "phases_s": {}}
    t_start = time.perf_counter()

    @contextmanager
    def phase(name: str):
        """Time a phase, record an exception instead of stopping (later phases report what they can), save."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001  (one run on a lent GPU: keep going, say what failed)
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:1500]}"
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()  # an OOM leaves its memory reserved; the next phase's load check counts it used
        res["phases_s"][name] = round(time.perf_counter() - t0, 2)
        res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        (a.out / out_name).write_text(json.dumps(res, indent=1))
        print(f"[{res['elapsed_s']:7.1f} s] {name} done", flush=True)

    # ---- rates of this GPU ----------------------------------------------------------------------------------
    with phase("rates"):
        from triton.testing import do_bench
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        res["matmul_bf16_tflops"] = 2 * 8192**3 / do_bench(lambda: x @ x) / 1e9
        buf = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        res["copy_read_tbps"] = buf.numel() / do_bench(lambda: buf.clone()) / 1e9  # bytes read per second
        del x, buf

    # ---- checkpoint, compile, finalize ----------------------------------------------------------------------
    with phase("checkpoint"):
        cfg = bench_config()
        shutil.rmtree(a.work, ignore_errors=True)
        ckpt, art = a.work / "ckpt", a.work / "art"
        model = save_random_checkpoint(cfg, ckpt, seed=0, dtype=torch.bfloat16, expert_format=a.experts,
                                       shard_bytes=2**30, device="cuda")
        model = model.cast_(torch.bfloat16).eval()  # returned in fp32: eager bf16 is the checkpoint as stored
    if "eager" not in skip:
        with phase("eager_prefill"):  # before k3c loads: eager prefill at batch 16 needs the memory k3c holds
            for B in (1, 16):
                toks = torch.randint(0, cfg.vocab_size, (B, PROMPT), device="cuda")
                with torch.no_grad():
                    s = timed(lambda: eager_prefill(model, toks, a.max_prefill), 3)
                    res.setdefault("prefill", {})[f"B{B}"] = {"eager_s": s}
                del toks
                torch.cuda.empty_cache()
    if not {"eager", "torch_compile", "numerics"} - skip:     # no phase left needs the eager model: free its memory
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    with phase("compile"):
        opts = CompileOptions(str(ckpt), art, target="h200", max_batch=64, max_seq=a.max_seq,
                              max_prefill=a.max_prefill, dtype="bf16", kda_state_dtype=a.kda_state)
        summary = compile_model(opts)
        res["compile"] = {"seconds": summary["seconds"], "kernels": summary["kernels"],
                          "arena_gib": {e: b / 2**30 for e, b in summary["arena"].items()},
                          "pools_gib": sum(summary["pools"].values()) / 2**30,
                          "bounds": {"max_batch": 64, "max_seq": a.max_seq, "max_prefill": a.max_prefill},
                          "kda_state": a.kda_state}
    with phase("load_and_finalize"):
        # finalize: compile the kernels on a warm-up and add them to the artifact
        session = k3c.load(art, "cuda", finalize="finalize" not in skip)
        res["finalize"] = session.finalized
    if "load_and_finalize" in res.get("errors", {}):     # stop rather than report each later phase failing too
        print("the artifact did not load (errors.load_and_finalize): the later phases are not run", flush=True)
        return

    # ---- first logits after load, fresh process, empty Triton cache -----------------------------------------
    weight_bytes = sum(f.stat().st_size for f in (art / "weights").iterdir())
    if "first_logits" not in skip:
        with phase("first_logits"):
            torch.cuda.empty_cache()  # the fresh process needs the GPU memory this one has cached but not in use
            fresh = a.work / "fresh-triton-cache"
            env = {**os.environ, "TRITON_CACHE_DIR": str(fresh)}
            p = subprocess.run([sys.executable, "-c", FIRST_LOGITS, str(art), str(fresh), str(PROMPT)], env=env,
                               capture_output=True, text=True)
            try:
                res["first_logits"] = json.loads(p.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                res["first_logits"] = {"error": (p.stderr or p.stdout)[-2000:]}
            res["first_logits"]["weights_gib"] = weight_bytes / 2**30

    # ---- k3c: decode grid, prefill, breakdown ---------------------------------------------------------------
    with phase("k3c_decode"):
        weights = session.weights
        fpt = matmul_flops_per_token(cfg, weights)
        decode = res.setdefault("decode", {})
        for L in (4096, 131072):
            for B in (1, 16, 64):
                if L + 1 > session.max_seq:
                    continue
                session.reset()
                random_caches(session)
                tok = decode_tokens(B, cfg.vocab_size)

                def step():
                    session.length, session.batch = L, B  # a fixed context (module docstring)
                    session.decode(tok)

                step()  # eager step, captures the graphs
                if not decode:  # the first figure: ~1 s of steps brings the GPU's clocks up after idle phases
                    for _ in range(300):
                        step()
                    torch.cuda.synchronize()
                fb = floor_bytes(cfg, weights, B, L, 2 if a.kda_state == "bf16" else 4)
                session.length, session.batch = L, B  # then a decode loop: the context grows by one a step
                decode[f"B{B}_L{L}"] = {"k3c_ms": timed(lambda: session.decode(tok), 20) * 1e3,
                                        "floor_ms": fb / HBM_BPS * 1e3, "floor_gb": fb / 1e9}
                d = decode[f"B{B}_L{L}"]
                d["k3c_of_floor"] = d["floor_ms"] / d["k3c_ms"]
                d["whole_step_graph"] = B in session._graphs  # one graph replay per step, nothing launched beside

                def gen(n):  # greedy generation of n tokens from the context L (`Session.generate`)
                    session.length, session.batch = L, B
                    session.generate(tok, n)

                gen(3)  # captures the greedy graph
                d["generate_step_ms"] = (timed(lambda: gen(21), 5) - timed(lambda: gen(1), 5)) / 20 * 1e3
                d["generate_of_floor"] = d["floor_ms"] / d["generate_step_ms"]
                if d["whole_step_graph"] and L == 4096:  # where the step's time goes: GPU in the graph vs host
                    g = session._graphs[B].graph  # (replays move the lengths on; the next step() sets them)
                    d["graph_ms"] = graph_ms(g)
                    d["check_ms"] = timed(lambda: session._check(tok), 20) * 1e3
                    d["timeline_graph"], d["timeline_step"] = timeline(g.replay), timeline(step)
    with phase("k3c_prefill"):
        prefill = res.setdefault("prefill", {})
        for B in (1, 16):
            toks = torch.randint(0, cfg.vocab_size, (B, PROMPT), device="cuda")

            def run():
                session.reset()
                session.prefill(toks)

            s = timed(run, 3)
            prefill.setdefault(f"B{B}", {}).update(k3c_s=s, tokens_per_s=B * PROMPT / s,
                                                   matmul_tflops=fpt * B * PROMPT / s / 1e12)
        res["breakdown"] = {}
        session.reset()
        graphs, session._graphs, session.cuda_graphs = session._graphs, {}, False  # kernels launched one by one
        random_caches(session)
        expert_bytes = sum(w.numel() * w.element_size() for n, w in weights.items() if ".experts." in n)
        for B, L in ((1, 4096), (16, 4096), (1, 131072), (16, 131072)):
            if L + 1 > session.max_seq:
                continue
            tokB = decode_tokens(B, cfg.vocab_size)

            def one_step():
                session.length, session.batch = L, B
                session.decode(tokB)

            br = res["breakdown"][f"decode_B{B}_L{L}"] = profile(one_step, DECODE_PROFILE_CALLS)
            if L != 4096:
                continue
            touched = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** B  # as `floor_bytes`
            ms = br.get("moe experts (Triton)", {}).get("ms")
            res.setdefault("expert_read_tbps", {})[f"B{B}"] = expert_bytes * touched / ms / 1e9 if ms else None
        toks = torch.randint(0, cfg.vocab_size, (16, a.max_prefill), device="cuda")

        def one_chunk():
            session.reset()
            session.prefill(toks)

        br = res["breakdown"][f"prefill_B16_T{a.max_prefill}"] = profile(one_chunk)
        gemm_s = sum(br.get(k, {}).get("ms", 0) for k in ("gemm (cuBLAS)", "moe experts (Triton)")) / 1e3
        res["prefill_gemm"] = {"tflops": fpt * toks.numel() / gemm_s / 1e12 if gemm_s else None,
                               "of_matmul_rate": fpt * toks.numel() / gemm_s / 1e12 / res["matmul_bf16_tflops"]
                               if gemm_s else None}
        session._graphs, session.cuda_graphs = graphs, True

    # ---- eager ----------------------------------------------------------------------------------------------
    if "eager" not in skip:
        with phase("eager"):
            for L in (4096, 131072):
                for B in (1, 16, 64):
                    key = f"B{B}_L{L}"
                    if key not in decode or (L > 4096 and B > 16):
                        continue
                    try:
                        e = EagerDecode(model, B, L)
                        decode[key]["eager_ms"] = timed(e.step, 5) * 1e3
                        decode[key]["k3c_speedup_vs_eager"] = decode[key]["eager_ms"] / decode[key]["k3c_ms"]
                        del e
                    except torch.OutOfMemoryError as err:
                        decode[key]["eager_ms"] = f"out of memory: {str(err)[:120]}"
                    torch.cuda.empty_cache()
            for B in (1, 16):
                if f"B{B}" in prefill and "eager_s" in prefill[f"B{B}"]:
                    prefill[f"B{B}"]["k3c_speedup_vs_eager"] = prefill[f"B{B}"]["eager_s"] / prefill[f"B{B}"]["k3c_s"]

    # ---- torch.compile --------------------------------------------------------------------------------------
    if "torch_compile" not in skip:
        with phase("torch_compile"):
            import torch._dynamo as dynamo  # (a bare `import torch._dynamo` would make `torch` local to main)

            for knob in ("recompile_limit", "cache_size_limit"):  # the name differs between torch versions
                if hasattr(dynamo.config, knob):
                    setattr(dynamo.config, knob, 64)
            compiled = torch.compile(model, dynamic=True)
            for B in (1, 16):
                key = f"B{B}_L4096"
                e = EagerDecode(model, B, 4096)
                e.model = compiled
                t1 = time.perf_counter()
                e.step()
                torch.cuda.synchronize()
                decode[key]["torch_compile_first_call_s"] = time.perf_counter() - t1
                decode[key]["torch_compile_ms"] = timed(e.step, 10) * 1e3
                decode[key]["k3c_speedup_vs_torch_compile"] = decode[key]["torch_compile_ms"] / decode[key]["k3c_ms"]
                del e
                torch.cuda.empty_cache()
            del compiled

    # ---- numerics: k3c bf16 vs eager bf16, in the band of eager bf16 vs eager fp32 --------------------------
    if "numerics" not in skip:
        with phase("numerics"):
            session.reset()
            prompt = torch.randint(0, cfg.vocab_size, (NUMERICS_BATCH, 256),
                                   generator=torch.Generator().manual_seed(0)).cuda()
            model32 = copy.deepcopy(model).float()  # the same checkpoint in fp32
            outs = {"k3c": [], "eager_bf16": [], "eager_fp32": []}
            with torch.no_grad(), routes_recorded(session, {"eager_bf16": model, "eager_fp32": model32}) as ids:
                l32, c32 = model32(prompt)
                l16, c16 = model(prompt)
                outs["eager_fp32"].append(l32[:, -1:].float())
                outs["eager_bf16"].append(l16[:, -1:].float())
                outs["k3c"].append(session.prefill(prompt).float())
                for _ in range(NUMERICS_STEPS):
                    nxt = outs["eager_fp32"][-1].argmax(-1)  # teacher forcing: the fp32 greedy continuation
                    l32, c32 = model32(nxt, c32)
                    l16, c16 = model(nxt, c16)
                    outs["eager_fp32"].append(l32.float())
                    outs["eager_bf16"].append(l16.float())
                    outs["k3c"].append(session.decode(nxt).float())

            def rel(x, y) -> list[float]:
                """Per position (each prompt's last, then each decode step's, prompt-major within a call):
                max |x - y| / max |y| over the vocabulary."""
                return [float(v) for p, q in zip(outs[x], outs[y])
                        for v in (p - q).abs().amax((1, 2)) / q.abs().amax((1, 2))]

            pairs = {"k3c_vs_eager_bf16": ("k3c", "eager_bf16"), "k3c_vs_eager_fp32": ("k3c", "eager_fp32"),
                     "eager_bf16_vs_eager_fp32": ("eager_bf16", "eager_fp32")}
            errs = {name: rel(*xy) for name, xy in pairs.items()}
            res["numerics_max_rel"] = {name: max(e) for name, e in errs.items()}
            # a random router's near-ties flip a top-k choice now and then in any bf16 run; which positions flip
            # differs between runs, so the band is the distribution over positions, not one maximum
            res["numerics_over_positions"] = {
                name: {"median": statistics.median(e), "p90": sorted(e)[int(0.9 * (len(e) - 1))], "max": max(e),
                       "share_above_0.05": sum(x > 0.05 for x in e) / len(e)} for name, e in errs.items()}
            for x in ("k3c", "eager_bf16"):
                same = torch.cat([(p.argmax(-1) == q.argmax(-1)).flatten()
                                  for p, q in zip(outs[x], outs["eager_fp32"])])
                res["numerics_max_rel"][f"greedy_agreement_{x}_vs_fp32"] = float(same.float().mean())

            def last_rows(i: torch.Tensor) -> torch.Tensor:
                """The ids [tokens, k] of a call's last position of each prompt: [NUMERICS_BATCH, k]."""
                return i.view(NUMERICS_BATCH, -1, i.shape[-1])[:, -1]

            # per position: did any MoE layer choose other experts than eager fp32 for the token whose logits are
            # compared (each prompt's last, then each decode step's)? The error where every layer agrees is the
            # arithmetic's; where one flipped, it is which near-tied expert won
            flipped = {x: [f for p in range(len(outs["k3c"])) for f in torch.stack(
                [route_sets_differ(last_rows(ids[x][i][p]), last_rows(ids["eager_fp32"][i][p]))
                 for i in ids["eager_fp32"]]).any(0).tolist()] for x in ("k3c", "eager_bf16")}
            res["numerics_by_route"] = {}
            for x in ("k3c", "eager_bf16"):
                e = errs[f"{x}_vs_eager_fp32"]
                same = [v for v, f in zip(e, flipped[x]) if not f]
                flip = [v for v, f in zip(e, flipped[x]) if f]
                res["numerics_by_route"][x] = {"positions": len(e), "route_flipped": len(flip),
                                               "max_where_routes_agree": max(same, default=None),
                                               "p90_where_routes_agree": sorted(same)[int(0.9 * (len(same) - 1))]
                                               if same else None,
                                               "max_where_flipped": max(flip, default=None)}
            res["numerics_per_layer"] = layer_errors(session, {"eager_bf16": model, "eager_fp32": model32}, prompt)
            res["route_disagreement"] = route_disagreement(session, {"eager_bf16": model, "eager_fp32": model32},
                                                           prompt)
            del model32, outs, c32, c16
            torch.cuda.empty_cache()

    # ---- MXFP4 checkpoint: the same decode with a dequantized (bf16-expert) build, side by side ------------------
    if a.experts == "mxfp4" and "bf16_build" not in skip:
        with phase("bf16_experts_build"):
            session = weights = graphs = None  # the first session's memory goes back before the second loads
            s16 = load_second(ckpt, a.work / "art-bf16-experts", max_batch=16, max_seq=4096 + 64,
                              max_prefill=a.max_prefill, experts_dtype="bf16")
            random_caches(s16)
            for B in (1, 16):
                tok = decode_tokens(B, cfg.vocab_size)

                def step16():
                    s16.length, s16.batch = 4096, B
                    s16.decode(tok)

                step16()
                d = decode[f"B{B}_L4096"]
                d["bf16_experts_build_ms"] = timed(step16, 20) * 1e3
                d["mxfp4_speedup_vs_bf16_experts"] = d["bf16_experts_build_ms"] / d["k3c_ms"]
            del s16
            gc.collect()
            torch.cuda.empty_cache()

    # ---- batch 4 x 32K context in 8K prefill chunks: a second artifact, the first session released ------------
    if "long" not in skip:
        with phase("long_context"):
            session = weights = graphs = None  # the first session's memory goes back before the second loads
            gc.collect()
            base = torch.cuda.memory_allocated()
            s8 = load_second(ckpt, a.work / "art-8k", max_batch=4, max_seq=32768 + 1024, max_prefill=8192)
            torch.cuda.synchronize()
            loaded = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            toks = torch.randint(0, cfg.vocab_size, (4, 32768), device="cuda")
            t1 = time.perf_counter()
            with launch_transients() as transients:
                out = s8.prefill(toks)
                torch.cuda.synchronize()
            planned = (s8.arena.numel() + sum(p.numel() * p.element_size() for p in s8.pools.values())
                       + sum(w.numel() * w.element_size() for w in s8.weights.values()))
            res["long_context"] = {"batch": 4, "tokens": 32768, "chunk": 8192, "prefill_s": time.perf_counter() - t1,
                                   "logits_shape": list(out.shape), "planned_gib": planned / 2**30,
                                   "allocated_after_load_gib": loaded / 2**30,
                                   "peak_gib": (transients["peak"] - base) / 2**30,
                                   "peak_above_plan_gib": (transients["peak"] - base - planned) / 2**30,
                                   "largest_launch_transients_gib": transients["largest"][:12]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
