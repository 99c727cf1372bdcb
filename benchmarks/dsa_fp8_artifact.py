"""FP8 DSA index keys in the compiled model (`k3c compile --dsa-index-keys fp8`): the artifact on the GPU against the
CPU interpreter, and the compiled indexer's time with fp8 vs bf16 keys at long context.

Two steps:
  --build DIR (CPU)   a random k3.1-pro-tiny checkpoint (seed 1, f32) and three h200 artifacts of it:
                      `f32_fp8` (dtype f32, fp8 keys: the accuracy check), `bf16_keys` and `fp8_keys` (dtype bf16,
                      max_batch 16, max_seq 131072 + 64: the timing); then the f32_fp8 artifact run by the CPU
                      runtime (Triton kernels interpreted) on a PROMPT-token prompt and STEPS decode steps, its logits
                      saved as DIR/cpu_logits.pt
  --run DIR --out OUT (GPU)  the f32_fp8 artifact on the GPU on the same tokens against the saved CPU logits (max
                      |a - b| / max |b| per call); then for each timing artifact and batch in (1, 16): the index-key
                      and latent pools filled with random keys (LayerNorm'd Gaussians, quantized per key for fp8, as
                      the append does) at context L = 131072, one decode step profiled without CUDA graphs
                      (torch.profiler: the dsa_index_topk kernels per step, summed over the 3 DSA layers), and the
                      decode step timed with CUDA graphs (mean of 50 replays). Writes OUT/dsa_fp8_artifact.json.
Usage:
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dsa_fp8_artifact.py --build build/fp8
    python3 benchmarks/dsa_fp8_artifact.py --run build/fp8 --out $OUT          # on the H200
The tiny model's indexer is 4 heads of 16 (K3.1 Pro: 32 of 128), so its scan moves 16 (bf16: 32) bytes per key:
the times measure the compiled path's launches and selection, not K3.1 Pro's scan (bench_dsa.py does that).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PROMPT, STEPS, L_LONG, BATCHES = 20, 4, 131072, (1, 16)
INDEX_KERNELS = ("dsa_score_kernel", "dsa_init_kernel", "dsa_scan_kernel", "dsa_collect_kernel", "dsa_refine_kernel",
                 "dsa_finish_kernel")


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(7))


def _run(session, tokens) -> list[torch.Tensor]:
    """Logits [1, vocab] f32 of the prompt's prefill and of each decode step."""
    out = [session.prefill(tokens[:, :PROMPT])[:, -1].float().cpu()]
    for t in range(PROMPT, tokens.shape[1]):
        out.append(session.decode(tokens[:, t:t + 1])[:, 0].float().cpu())
    return out


def build(root: Path) -> None:
    import k3c
    from k3c.compile import CompileOptions, compile_model
    from models.k3 import K3Config, save_random_checkpoint

    cfg = K3Config.from_pretrained("k3.1-pro-tiny")
    save_random_checkpoint(cfg, root / "ckpt", seed=1, dtype=torch.float32)
    ck = str(root / "ckpt")
    compile_model(CompileOptions(ck, root / "f32_fp8", target="h200", dtype="f32", max_batch=1,
                                 max_seq=PROMPT + STEPS, max_prefill=PROMPT, dsa_index_keys="fp8", force=True))
    for name, keys in (("bf16_keys", "bf16"), ("fp8_keys", "fp8")):
        compile_model(CompileOptions(ck, root / name, target="h200", dtype="bf16", max_batch=max(BATCHES),
                                     max_seq=L_LONG + 64, max_prefill=64, dsa_index_keys=keys, force=True))
    logits = _run(k3c.load(root / "f32_fp8", "cpu"), _tokens(cfg.vocab_size))
    torch.save(torch.stack(logits), root / "cpu_logits.pt")


def _fill_pools(session, B: int, L: int) -> None:
    """Random LayerNorm'd index keys (quantized per key where the pool is e4m3) and latent rows for B x L tokens."""
    gen = torch.Generator(device=session.device).manual_seed(0)
    for name, pool in session.pools.items():
        if name.endswith(".index_k"):
            D = pool.shape[-1]
            k = torch.nn.functional.layer_norm(torch.randn(B, L, D, generator=gen, device=session.device), (D,))
            if pool.dtype == torch.float8_e4m3fn:
                amax = k.abs().amax(-1)
                scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
                pool[:B, :L] = (k / scale[..., None]).to(torch.float8_e4m3fn)
                session.pools[name + "_scale"][:B, :L] = scale
            else:
                pool[:B, :L] = k.to(pool.dtype)
        elif name.endswith(".kv"):
            rows = torch.randn(B, L, pool.shape[-1], generator=gen, device=session.device)
            pool[:B, :L] = (rows * 0.3).to(pool.dtype)


def _index_us(session, tokens) -> dict[str, float]:
    """One decode step without CUDA graphs under torch.profiler: device microseconds of the dsa_index_topk kernels
    (by kernel name, summed over the layers) and of every kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        session.decode(tokens)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    total = 0.0
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total += us
        for k in INDEX_KERNELS:
            if k in e.key:
                out[k] = out.get(k, 0.0) + us
    out["dsa_index_topk"] = sum(v for k, v in out.items() if k in INDEX_KERNELS)
    out["all_kernels"] = total
    return out


def run(root: Path, out_dir: Path) -> None:
    import k3c

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    cpu = torch.load(root / "cpu_logits.pt")
    session = k3c.load(root / "f32_fp8", "cuda")
    gpu = torch.stack(_run(session, _tokens(session.vocab)))
    rel = ((gpu - cpu).abs().amax(-1) / cpu.abs().amax(-1)).flatten().tolist()
    res["f32_fp8_gpu_vs_cpu_interpreter"] = {"max_rel_per_call": rel, "worst": max(rel),
                                             "greedy_agree": bool((gpu.argmax(-1) == cpu.argmax(-1)).all())}
    print(json.dumps(res, indent=1), flush=True)
    for name in ("bf16_keys", "fp8_keys"):
        for B in BATCHES:
            row = {}
            for graphs in (False, True):
                s = k3c.load(root / name, "cuda", cuda_graphs=graphs)
                _fill_pools(s, B, L_LONG)
                s.length = L_LONG
                tok = torch.randint(0, s.vocab, (B, 1), device="cuda")
                if not graphs:
                    s.decode(tok)                       # Triton JIT, cuBLAS setup
                    s.length = L_LONG
                    row["profile_us"] = _index_us(s, tok)
                else:
                    s.decode(tok)                       # eager step, then the graph is captured
                    s.decode(tok)
                    n = 50
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(n):                  # the context grows by one per step, from L_LONG + 2
                        s.decode(tok)
                    torch.cuda.synchronize()
                    row["decode_step_us_cuda_graphs"] = (time.perf_counter() - t0) / n * 1e6
                del s
                torch.cuda.empty_cache()
            res[f"{name}_B{B}_L{L_LONG}"] = row
            print(name, B, json.dumps(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "dsa_fp8_artifact.json").write_text(json.dumps(res, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    if a.build:
        build(a.build)
    if a.run:
        run(a.run, a.out)


if __name__ == "__main__":
    main()
