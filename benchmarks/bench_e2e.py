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
   is reported beside it). The cache contents do not change a step's work: contexts are set, not prefilled;
4. prefill of 2560-token prompts at batch 1 and 16 (tokens/s, TFLOP/s of the model's matmuls) and the GEMM rate of
   the prefill against a plain bf16 matmul measured here; eager prefills in chunks of max_prefill tokens as k3c
   does (measured before k3c loads);
5. a per-kernel-kind breakdown (torch.profiler) of one decode step and one prefill call;
6. numerics: k3c bf16 vs eager bf16, in the band of eager bf16 vs eager fp32 (same checkpoint), over a prefill and
   64 teacher-forced decode steps (max and the distribution over positions: a random router's near-ties flip a
   top-k choice at some positions of any bf16 run, and which ones differs between runs); and per layer (input
   norm, mixer output after o_proj, MLP / MoE output) over the prefill, to see where a difference arises;
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
import textwrap
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

HBM_BPS = 4.2e12
PROMPT = 2560
NUMERICS_STEPS = 64  # teacher-forced decode steps compared (numerics phase)


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


def floor_bytes(cfg, weights: dict, B: int, L: int) -> int:
    """Bytes one decode step at batch B and context L must move (module docstring, item 3)."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    touched = 1 - (1 - k / E) ** B  # expected share of the routed experts a batch of B tokens selects
    total = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if "embed_tokens" in name:
            nbytes = B * t.shape[-1] * t.element_size()
        elif ".experts." in name:
            nbytes = int(nbytes * touched)
        total += nbytes
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_kind(i) == "kda":
            total += 2 * B * (H * K * K + 3 * H * K * cfg.conv_kernel_size) * 4  # states read and written, fp32
        else:
            rows = min(L, cfg.index_topk) if cfg.layer_kind(i) == "dsa" else L
            total += B * rows * cfg.mla_cache_width * 2
            if cfg.layer_kind(i) == "dsa":
                total += B * L * cfg.index_head_dim * 2
    return total


def matmul_flops_per_token(cfg, weights: dict) -> int:
    """2 x the matmul weights one token multiplies with: every 2-D projection but the embedding (a gather), and
    k of the E routed experts."""
    n = 0
    for name, t in weights.items():
        if "embed_tokens" in name or t.dim() < 2 or "conv1d" in name:
            continue
        if name.endswith(".weight_scale"):      # MXFP4 experts: E8M0 scales, no multiplies of their own
            continue
        per = 2 if name.endswith(".weight_packed") else 1   # MXFP4: two E2M1 weights per byte
        n += per * t.numel() * (cfg.num_experts_per_token / cfg.num_experts if ".experts." in name else 1)
    return int(2 * n)


def kind_of(kernel: str) -> str:
    """The kind of a GPU kernel by its name: gemm (cuBLAS / CUTLASS), the k3c Triton kernels by model op, copies."""
    k = kernel.lower()
    for kind, keys in (("moe experts (Triton)", ("moe_up", "moe_down")), ("moe (Triton)", ("moe_",)),
                       ("kda (Triton)", ("kda", "causal_conv", "roll_conv")),
                       ("attention (Triton)", ("mla_attention", "mla_combine")),
                       ("dsa indexer", ("dsa_score", "topk", "radix", "sort")), ("attn_res (Triton)", ("attn_res",)),
                       ("pointwise / rowwise (Triton)", ("pointwise", "rowwise")),
                       ("gemm (cuBLAS)", ("gemm", "cutlass", "xmma", "cublas", "splitk", "nvjet", "sm90_")),
                       ("copy / fill", ("copy", "memcpy", "memset", "fill", "cat"))):
        if any(x in k for x in keys):
            return kind
    return "other (torch)"


def profile(fn) -> dict:
    """Kernel time (ms) and launches per kernel kind of one call of `fn` (after a warm-up call), torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    out: dict[str, dict] = {}
    names = []
    for e in p.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            row = out.setdefault(kind_of(e.key), {"ms": 0.0, "launches": 0})
            row["ms"] += us / 1e3
            row["launches"] += e.count
            names.append((e.count, round(us / 1e3, 4), e.key[:90]))
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))
    out["kernels_by_launches"] = sorted(names, reverse=True)[:40]  # (launches, ms, kernel name)
    return out


def timed(fn, reps: int) -> float:
    """Median seconds of `reps` calls of `fn`, each synchronised."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def eager_prefill(model, tokens, chunk: int):
    """models/k3.py eager prefill of `tokens` [B,T] in chunks of `chunk` tokens (as k3c prefills: its max_prefill),
    returning the last position's logits as k3c's prefill does (`logits="last"`): the body over every token, the
    lm_head on the last row only. Whole-prompt eager at batch 16 x 2560 would not fit: its naive attention scores
    are [16, 96, 2560, 2560] fp32 (37.5 GiB), and every row's logits 12.5 GiB that k3c never computes."""
    cache = model.new_cache(tokens.shape[0], tokens.device)
    for t0 in range(0, tokens.shape[1], chunk):
        part = tokens[:, t0:t0 + chunk]
        new_cache = {"pos": cache["pos"] + part.shape[1]}
        hidden = model.model(part, cache, new_cache)
        cache = new_cache
    return model.lm_head(hidden[:, -1:])


def load_second(ckpt: Path, art: Path, **bounds):
    """Compile `ckpt` again for the H200 in bf16 at other `bounds` (CompileOptions fields) and load it, after the
    memory the caller released is handed back to the device (collected, the allocator's cache emptied)."""
    import k3c
    from k3c.compile import CompileOptions, compile_model

    gc.collect()
    torch.cuda.empty_cache()
    compile_model(CompileOptions(str(ckpt), art, target="h200", dtype="bf16", **bounds))
    return k3c.load(art, "cuda")


def decode_tokens(B: int, vocab: int) -> torch.Tensor:
    """long [B, 1] on the GPU: distinct random tokens, so the rows of a batch route to different experts (one
    token repeated would route every row alike and read only k of the E experts, below `floor_bytes`)."""
    return torch.randint(0, vocab, (B, 1), generator=torch.Generator().manual_seed(B)).cuda()


class EagerDecode:
    """models/k3.py eager at a fixed context: a cache of L zero rows (the values do not change the work)."""

    def __init__(self, model, B: int, L: int):
        self.model, self.cache = model, model.new_cache(B)
        for key, v in self.cache.items():
            if key.endswith((".kv", ".index_k")):
                self.cache[key] = torch.zeros(B, L, v.shape[-1], dtype=v.dtype, device=v.device)
        self.cache["pos"] = torch.tensor(L, device=self.cache["pos"].device)
        self.tokens = decode_tokens(B, model.config.vocab_size)

    @torch.no_grad()
    def step(self):
        return self.model(self.tokens, self.cache)[0]


@contextmanager
def launch_transients():
    """Within the block, each launch's transient memory: the allocator's peak during the launch above what was
    allocated before it (what the launch allocates beside its planned buffers: temporaries, copies), from the CUDA
    allocator's counters (no synchronisation). Yields a dict: "peak" (bytes, the block's peak allocation, which
    max_memory_allocated no longer gives: it is reset per launch) and, when the block ends, "largest" ([GiB, launch
    name, kind, backend], largest first)."""
    from k3c.runtime.frame import Frame

    launch, rows, found = Frame.launch, {}, {"peak": torch.cuda.max_memory_allocated(), "largest": []}

    def tracked(frame, ln):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        launch(frame, ln)
        peak = torch.cuda.max_memory_allocated()
        found["peak"] = max(found["peak"], peak)
        if peak - before > rows.get(ln["name"], (0,))[0]:
            rows[ln["name"]] = (peak - before, ln["kind"], ln["backend"])

    Frame.launch = tracked
    try:
        yield found
    finally:
        Frame.launch = launch
        found["largest"] = [[round(b / 2**30, 3), name, kind, backend] for name, (b, kind, backend) in
                            sorted(rows.items(), key=lambda kv: -kv[1][0])]


def layer_errors(session, models: dict, prompt) -> dict:
    """Per layer i, over one prefill of `prompt`: max |a−b| / max |b| of the input norm's output ("norm"), the
    mixer's output after o_proj ("mixer") and the MLP / MoE output ("ffn"), k3c vs eager bf16, eager bf16 vs eager
    fp32 and k3c vs eager fp32
    (`models`: {"eager_bf16": model, "eager_fp32": model}); where the k3c error exceeds the eager band first is
    where it arises. k3c's values are kept as its launches write them (`Frame.launch` wrapped: the values named
    l<i>.input_layernorm[.n], l<i>.self_attn.o_proj, and the last [B,T,hidden] value of l<i>.mlp* /
    l<i>.block_sparse_moe*), the eager ones by forward hooks."""
    import re

    from k3c.runtime.frame import Frame

    acts: dict[str, dict] = {"k3c": {}, **{name: {} for name in models}}
    pattern = re.compile(r"l(\d+)\.(input_layernorm|self_attn\.o_proj|mlp|block_sparse_moe)(\..+)?$")
    part_of = {"input_layernorm": "norm", "self_attn.o_proj": "mixer", "mlp": "ffn", "block_sparse_moe": "ffn"}
    launch = Frame.launch

    def hidden_width(frame) -> int:
        return frame.env["embed.embed_tokens"].shape[-1]

    def keep(frame, ln):
        launch(frame, ln)
        for v in ln["outputs"]:
            m, t = pattern.match(v), frame.env.get(v)
            if m and (part_of[m[2]] != "ffn" or (t.dim() == 3 and t.shape[-1] == hidden_width(frame))):
                acts["k3c"][f"{m[1]}.{part_of[m[2]]}"] = t.float().clone()

    hooks = []
    for name, model in models.items():
        for i, layer in enumerate(model.model.layers):
            ffn = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
            for part, mod in (("norm", layer.input_layernorm), ("mixer", layer.self_attn), ("ffn", ffn)):
                hooks.append(mod.register_forward_hook(
                    lambda m, args, out, key=f"{i}.{part}", d=acts[name]: d.__setitem__(
                        key, (out[0] if isinstance(out, tuple) else out).float().clone())))
    Frame.launch = keep
    try:
        with torch.no_grad():
            session.reset()
            session.prefill(prompt)
            for model in models.values():
                model(prompt)
    finally:
        Frame.launch = launch
        for h in hooks:
            h.remove()
        session.reset()

    def rel(a, b, key):
        x, y = acts[a].get(key), acts[b].get(key)
        return float((x - y).abs().max() / y.abs().max()) if x is not None and y is not None else None

    keys = sorted(set(acts["eager_bf16"]), key=lambda k: (int(k.split(".")[0]), k))
    return {k: {"k3c_vs_eager_bf16": rel("k3c", "eager_bf16", k), "eager_bf16_vs_eager_fp32": rel(
        "eager_bf16", "eager_fp32", k), "k3c_vs_eager_fp32": rel("k3c", "eager_fp32", k)} for k in keys}


FIRST_LOGITS = textwrap.dedent("""
    import cProfile, io, json, pathlib, pstats, sys, time
    t0 = time.perf_counter()
    import torch, triton, k3c
    torch.zeros(1, device="cuda"); triton.runtime.driver.active.utils  # CUDA context, Triton's driver helpers
    t1 = time.perf_counter()
    s = k3c.load(sys.argv[1], "cuda")
    torch.cuda.synchronize(); t2 = time.perf_counter()
    tokens = torch.randint(0, s.vocab, (1, int(sys.argv[3])))
    prof = cProfile.Profile()
    prof.enable()
    logits = s.prefill(tokens)
    torch.cuda.synchronize(); t3 = time.perf_counter()
    prof.disable()
    s.reset(); s.prefill(tokens); torch.cuda.synchronize(); t4 = time.perf_counter()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    compiled = sorted(str(p.name) for p in pathlib.Path(sys.argv[2]).rglob("*.llir"))
    print(json.dumps({"process_setup_s": t1 - t0, "load_s": t2 - t1, "load_parts_s": s.load_seconds,
                      "first_prefill_s": t3 - t2, "second_prefill_s": t4 - t3,
                      "kernels_compiled": len(compiled), "compiled": compiled[:8],
                      "kernel_files_installed": s.launchers["triton"].compiled_kernels,
                      "logits_finite": bool(torch.isfinite(logits).all()),
                      "first_prefill_profile": text.getvalue().splitlines()[:60]}))
""")


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
    with phase("compile"):
        opts = CompileOptions(str(ckpt), art, target="h200", max_batch=64, max_seq=a.max_seq,
                              max_prefill=a.max_prefill, dtype="bf16")
        summary = compile_model(opts)
        res["compile"] = {"seconds": summary["seconds"], "kernels": summary["kernels"],
                          "arena_gib": {e: b / 2**30 for e, b in summary["arena"].items()},
                          "pools_gib": sum(summary["pools"].values()) / 2**30,
                          "bounds": {"max_batch": 64, "max_seq": a.max_seq, "max_prefill": a.max_prefill}}
    with phase("load_and_finalize"):
        # finalize: compile the kernels on a warm-up and add them to the artifact
        session = k3c.load(art, "cuda", finalize="finalize" not in skip)
        res["finalize"] = session.finalized

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
                tok = decode_tokens(B, cfg.vocab_size)

                def step():
                    session.length, session.batch = L, B  # a fixed context (module docstring)
                    session.decode(tok)

                step()  # eager step, captures the graphs
                if not decode:  # the first figure: ~1 s of steps brings the GPU's clocks up after idle phases
                    for _ in range(300):
                        step()
                    torch.cuda.synchronize()
                fb = floor_bytes(cfg, weights, B, L)
                decode[f"B{B}_L{L}"] = {"k3c_ms": timed(step, 20) * 1e3, "floor_ms": fb / HBM_BPS * 1e3,
                                        "floor_gb": fb / 1e9}
                d = decode[f"B{B}_L{L}"]
                d["k3c_of_floor"] = d["floor_ms"] / d["k3c_ms"]
                d["whole_step_graph"] = B in session._graphs  # one graph replay per step, nothing launched beside
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
        expert_bytes = sum(w.numel() * w.element_size() for n, w in weights.items() if ".experts." in n)
        for B in (1, 16):
            tokB = decode_tokens(B, cfg.vocab_size)

            def one_step():
                session.length, session.batch = 4096, B
                session.decode(tokB)

            br = res["breakdown"][f"decode_B{B}_L4096"] = profile(one_step)
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
            prompt = torch.randint(0, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0)).cuda()
            model32 = copy.deepcopy(model).float()  # the same checkpoint in fp32
            outs = {"k3c": [], "eager_bf16": [], "eager_fp32": []}
            with torch.no_grad():
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
                """Per position (the prompt's last, then each decode step): max |x - y| / max |y|."""
                return [float((p - q).abs().max() / q.abs().max()) for p, q in zip(outs[x], outs[y])]

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
                same = [bool((p.argmax(-1) == q.argmax(-1)).all()) for p, q in zip(outs[x], outs["eager_fp32"])]
                res["numerics_max_rel"][f"greedy_agreement_{x}_vs_fp32"] = sum(same) / len(same)
            res["numerics_per_layer"] = layer_errors(session, {"eager_bf16": model, "eager_fp32": model32}, prompt)
            del model32, outs, c32, c16
            torch.cuda.empty_cache()

    # ---- MXFP4 checkpoint: the same decode with a dequantized (bf16-expert) build, side by side ------------------
    if a.experts == "mxfp4" and "bf16_build" not in skip:
        with phase("bf16_experts_build"):
            session = weights = graphs = None  # the first session's memory goes back before the second loads
            s16 = load_second(ckpt, a.work / "art-bf16-experts", max_batch=16, max_seq=4096 + 64,
                              max_prefill=a.max_prefill, experts_dtype="bf16")
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
