"""Measurement parts of `bench_e2e.py` (its module docstring says what each phase measures): the HBM floor and FLOP
counts of the benchmark model, kernel-time profiles by kind, step timing, the eager baselines, per-launch transient
memory, per-layer numerics, and the first-logits probe run in a fresh process. GPU only (torch.cuda)."""

from __future__ import annotations

import gc
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import torch

HBM_BPS = 4.2e12  # the H200's achievable HBM read rate, bytes/s (measured; see BENCHMARKS.md)


def floor_bytes(cfg, weights: dict, B: int, L: int, state_bytes: int = 4, conv_bytes: int = 2) -> int:
    """Bytes one decode step at batch B and context L must move (module docstring, item 3); the KDA recurrent
    state at `state_bytes` per element (4: fp32, 2: `--kda-state bf16`), the conv state at `conv_bytes` (the
    activations' dtype: 2 in the bf16 builds benchmarked here; run H and earlier stored it in fp32 and counted 4)."""
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
            total += 2 * B * (H * K * K * state_bytes + 3 * H * K * cfg.conv_kernel_size * conv_bytes)  # read, written
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
    for kind, keys in (("moe experts (Triton)", ("moe_up", "moe_down", "moe_mx_wgmma_fused")),
                       ("moe (Triton)", ("moe_",)),
                       ("kda (Triton)", ("kda", "causal_conv", "roll_conv")),
                       ("attention (Triton)", ("mla_attention", "mla_combine", "mla_sparse_decode")),
                       ("dsa indexer", ("dsa_", "topk", "radix", "sort")), ("attn_res (Triton)", ("attn_res",)),
                       ("pointwise / rowwise (Triton)", ("pointwise", "rowwise")),
                       ("gemm (cuBLAS)", ("gemm", "cutlass", "xmma", "cublas", "splitk", "nvjet", "sm90_")),
                       ("copy / fill", ("copy", "memcpy", "memset", "fill", "cat"))):
        if any(x in k for x in keys):
            return kind
    return "other (torch)"


def profile(fn, calls: int = 1) -> dict:
    """Kernel time (ms) and launches per kernel kind of one call of `fn`, torch.profiler: the mean over `calls`
    calls (after a warm-up call), each synchronised. One call is one sample: two profiles of the same decode
    kernels (batch 16 at contexts 4K and 128K, BENCHMARKS.md "MXFP4 round, run AB") differed by 3 % in their
    expert kernels' time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    out: dict[str, dict] = {}
    names = []
    for e in p.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            row = out.setdefault(kind_of(e.key), {"ms": 0.0, "launches": 0})
            row["ms"] += us / 1e3 / calls
            row["launches"] += e.count / calls
            names.append((e.count / calls, round(us / 1e3 / calls, 4), e.key[:90]))
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))
    out["kernels_by_launches"] = sorted(names, reverse=True)[:40]  # (launches, ms, kernel name), a call's
    out["calls"] = calls
    return out


def timeline(fn, top: int = 8) -> dict:
    """GPU activity of one call of `fn` (after a warm-up call), from torch.profiler's kernel / copy records: the
    time in kernels, the span from the first one's start to the last one's end, the idle gaps between consecutive
    records (their sum and how many exceed 2 us) and the `top` largest with the records on either side (us)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in p.events()
                if e.device_type == DeviceType.CUDA)
    if not ev:
        return {}
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(ev, ev[1:])]
    return {"records": len(ev), "busy_us": sum(e - s for s, e, _ in ev), "span_us": ev[-1][1] - ev[0][0],
            "gaps_us": sum(max(g, 0) for g, _, _ in gaps), "gaps_over_2us": sum(g > 2 for g, _, _ in gaps),
            "largest_gaps": [[round(g, 1), x, y] for g, x, y in sorted(gaps, reverse=True)[:top]]}


def graph_ms(graph, reps: int = 20) -> float:
    """Milliseconds per replay of a captured `torch.cuda.CUDAGraph`, `reps` replays back to back between two CUDA
    events: the GPU's time for the step with no host work between steps."""
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    t0.record()
    for _ in range(reps):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


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
    allocated before it (what the launch allocates beside its planned buffers, arena and pools: temporaries, copies,
    scratch the plan does not hold), from the CUDA allocator's counters (no synchronisation). Yields a dict: "peak"
    (bytes, the block's peak allocation, which max_memory_allocated no longer gives: it is reset per launch) and,
    when the block ends, "largest" ([GiB above the plan, launch name, kind, backend, GiB of planned scratch the
    launch was handed (schedule.json "scratch", in the arena)], largest first)."""
    from k3c.runtime.frame import Frame

    launch, rows, found = Frame.launch, {}, {"peak": torch.cuda.max_memory_allocated(), "largest": []}

    def tracked(frame, ln):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        launch(frame, ln)
        peak = torch.cuda.max_memory_allocated()
        found["peak"] = max(found["peak"], peak)
        if peak - before > rows.get(ln["name"], (0,))[0]:
            planned = sum(t.numel() * t.element_size() for t in map(frame.out, ln.get("scratch", {}).values()))
            rows[ln["name"]] = (peak - before, ln["kind"], ln["backend"], planned)

    Frame.launch = tracked
    try:
        yield found
    finally:
        Frame.launch = launch
        found["largest"] = [[round(b / 2**30, 3), name, kind, backend, round(planned / 2**30, 3)]
                            for name, (b, kind, backend, planned) in sorted(rows.items(), key=lambda kv: -kv[1][0])]


def _prefill_watched(session, models: dict, prompt, keep, hooks) -> None:
    """Prefill `prompt` in k3c with `Frame.launch` replaced by `keep(frame, launch_record)` (which calls the original;
    None: unchanged) and in every eager model of `models`; then remove the forward `hooks` and reset the session,
    also on error."""
    from k3c.runtime.frame import Frame

    launch = Frame.launch
    Frame.launch = keep or launch
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


#: layer_errors' parts: the module (under model.layers.<i>) whose output is compared; k3c's IR names a value by the
#: module path that produced it (l<i>.<path>, optionally with a .<n> suffix for a later form of the same value)
LAYER_PARTS = {"norm": "input_layernorm", "mixer": "self_attn.o_proj", "mlp": "mlp.down_proj",
               "moe_routed": "block_sparse_moe.routed_expert_up_proj",
               "moe_shared": "block_sparse_moe.shared_experts.down_proj"}


def layer_errors(session, models: dict, prompt) -> dict:
    """Per layer i, over one prefill of `prompt`: max |a−b| / max |b| of each part's output (`LAYER_PARTS`: the input
    norm, the mixer after o_proj, the dense MLP, and a MoE's routed experts after the latent up-projection and its
    shared experts; the MoE output is their sum), k3c vs eager bf16, eager bf16 vs eager fp32 and k3c vs eager fp32
    (`models`: {"eager_bf16": model, "eager_fp32": model}); where the k3c error exceeds the eager band first is
    where it arises. k3c's values are kept as its launches write them (`Frame.launch` wrapped, the last value named
    l<i>.<path>[.n]), the eager ones by forward hooks on the same modules; both are compared as [tokens, width]."""
    import re

    from k3c.runtime.frame import Frame

    acts: dict[str, dict] = {"k3c": {}, **{name: {} for name in models}}
    part_of = {path: part for part, path in LAYER_PARTS.items()}
    pattern = re.compile(rf"l(\d+)\.({'|'.join(map(re.escape, part_of))})(\.\d+)?$")
    launch = Frame.launch

    def keep(frame, ln):
        launch(frame, ln)
        for v in ln["outputs"]:
            m = pattern.match(v)
            if m:
                acts["k3c"][f"{m[1]}.{part_of[m[2]]}"] = rows(frame.env[v])

    def rows(out) -> torch.Tensor:
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(-1, out.shape[-1]).float().clone()

    hooks = []
    for name, model in models.items():
        for i, layer in enumerate(model.model.layers):
            for part, path in LAYER_PARTS.items():
                try:
                    mod = layer.get_submodule(path)
                except AttributeError:  # a part this layer does not have
                    continue
                hooks.append(mod.register_forward_hook(
                    lambda m, args, out, key=f"{i}.{part}", d=acts[name]: d.__setitem__(key, rows(out))))
    _prefill_watched(session, models, prompt, keep, hooks)

    def rel(a, b, key):
        x, y = acts[a].get(key), acts[b].get(key)
        return float((x - y).abs().max() / y.abs().max()) if x is not None and y is not None else None

    keys = sorted(set(acts["eager_bf16"]), key=lambda k: (int(k.split(".")[0]), k))
    return {k: {"k3c_vs_eager_bf16": rel("k3c", "eager_bf16", k), "eager_bf16_vs_eager_fp32": rel(
        "eager_bf16", "eager_fp32", k), "k3c_vs_eager_fp32": rel("k3c", "eager_fp32", k)} for k in keys}


@contextmanager
def routes_recorded(session, models: dict):
    """Record the experts each MoE layer chooses, per call, while the block runs: yields {"k3c": {layer: [ids]},
    name: {layer: [ids]} for each eager model of `models`}, one int64 [tokens, k] entry per forward call in call
    order. k3c's are the `moe_route` launches' ids as they are written (`Frame.launch` wrapped; a CUDA-graph replay
    launches nothing from Python, so the session runs without graphs inside the block), the eager ones the same op
    on each MoE's input (a forward pre-hook; models/layers.py `MoE.forward` routes in fp32 in every model)."""
    import re

    import torch.nn.functional as F

    from k3c.runtime.frame import Frame

    ids: dict[str, dict[int, list]] = {"k3c": {}, **{name: {} for name in models}}
    launch = Frame.launch

    def keep(frame, ln):
        launch(frame, ln)
        if ln["kind"] == "moe_route":
            layer = int(re.match(r"l(\d+)\.", ln["outputs"][1])[1])
            ids["k3c"].setdefault(layer, []).append(frame.env[ln["outputs"][1]].clone())

    def route(moe, x, into):
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), moe.gate.weight.float())
        into.append(torch.ops.k3.moe_route(logits, moe.gate.e_score_correction_bias, moe.top_k, moe.scaling,
                                           moe.renorm)[1].clone())

    hooks = []
    for name, model in models.items():
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer, "block_sparse_moe"):
                hooks.append(layer.block_sparse_moe.register_forward_pre_hook(
                    lambda m, args, i=i, d=ids[name]: route(m, args[0], d.setdefault(i, []))))
    graphs, with_graphs = session._graphs, session.cuda_graphs
    session._graphs, session.cuda_graphs = {}, False
    Frame.launch = keep
    try:
        yield ids
    finally:
        Frame.launch = launch
        session._graphs, session.cuda_graphs = graphs, with_graphs
        for h in hooks:
            h.remove()


def route_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [tokens]: whether each token's set of chosen experts differs between ids `a` and `b` ([tokens, k])."""
    return (a.sort(-1).values != b.sort(-1).values.to(a.device)).any(-1)


def route_disagreement(session, models: dict, prompt) -> dict:
    """Per MoE layer i, over one prefill of `prompt`: the share of tokens whose set of chosen experts differs between
    k3c and eager fp32, eager bf16 and eager fp32, and k3c and eager bf16 (`models`: {"eager_bf16": model,
    "eager_fp32": model}; `routes_recorded`). A random router puts many experts near the top-k threshold, so any
    bf16 run flips some choices: the shares say whether k3c flips more often than eager bf16 does."""
    with routes_recorded(session, models) as ids:
        _prefill_watched(session, models, prompt, None, [])

    def differ(a, b, layer) -> float:
        return float(route_sets_differ(torch.cat(ids[a][layer]), torch.cat(ids[b][layer])).float().mean())

    return {layer: {"k3c_vs_eager_fp32": differ("k3c", "eager_fp32", layer),
                    "eager_bf16_vs_eager_fp32": differ("eager_bf16", "eager_fp32", layer),
                    "k3c_vs_eager_bf16": differ("k3c", "eager_bf16", layer)} for layer in sorted(ids["eager_bf16"])}


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
