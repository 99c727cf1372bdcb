"""Run a compiled artifact on the GPU and compare with `models/k3.py` eager (bf16 and fp32).

Usage (on the H200, through the device tool; the artifact and checkpoint are built on CPU first):
    python benchmarks/gpu_artifact_check.py --ckpt build/gpu/ckpt --artifact build/gpu/art --out $OUT
Prints and writes (to OUT/gpu_artifact_check.json) the max relative logit error of a 64-token prefill and 32
greedy decode steps, batch 1 and 3, against eager bf16 and eager fp32, with per-call wall times (CUDA synchronised).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import k3c
from models.k3 import load_checkpoint


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def position_stats(got, want):
    """Per-position relative error (max |diff| / max |want| over the vocab): the median and the 99th percentile
    over positions, and the fraction of positions whose greedy token agrees."""
    g, w = got.float().flatten(0, -2), want.float().flatten(0, -2)
    err = (g - w).abs().amax(-1) / w.abs().amax(-1)
    q = torch.quantile(err, torch.tensor([0.5, 0.99], device=err.device)).tolist()
    return {"median": q[0], "p99": q[1], "argmax_agree": float((g.argmax(-1) == w.argmax(-1)).float().mean())}


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--artifact32", default=None, help="an f32 artifact of the same checkpoint (exactness check)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    ref32 = load_checkpoint(a.ckpt, torch.float32, "cuda").eval()
    ref16 = load_checkpoint(a.ckpt, torch.bfloat16, "cuda").eval()
    session = k3c.load(a.artifact, "cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if a.artifact32:
        s32 = k3c.load(a.artifact32, "cuda")
        tok = torch.randint(0, ref32.config.vocab_size, (3, a.prompt), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad():
            want, cache = ref32(tok)
        errs = [rel(s32.prefill(tok), want)]
        nxt = want[:, -1:].argmax(-1)
        for _ in range(a.steps):
            with torch.no_grad():
                want, cache = ref32(nxt, cache)
            errs.append(rel(s32.decode(nxt), want))
            nxt = want[:, -1:].argmax(-1)
        results["f32_artifact_vs_eager_fp32_max"] = max(errs)
    for batch in (1, 3):
        session.reset()
        tok = torch.randint(0, ref32.config.vocab_size, (batch, a.prompt), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad():
            (w32, c32), _ = timed(lambda: ref32(tok))
            (w16, c16), t_eager = timed(lambda: ref16(tok))
        got, t_rt = timed(lambda: session.prefill(tok))
        row = {"prefill_vs_bf16": rel(got, w16), "prefill_vs_fp32": rel(got, w32), "eager_bf16_vs_fp32": rel(w16, w32),
               "prefill_positions_vs_bf16": position_stats(got, w16),
               "eager_bf16_positions_vs_fp32": position_stats(w16, w32),
               "prefill_s": t_rt, "eager_prefill_s": t_eager}
        nxt = w32[:, -1:].argmax(-1)
        errs16, errs32, ts, te = [], [], [], []
        for _ in range(a.steps):
            with torch.no_grad():
                w32, c32 = ref32(nxt, c32)
                (w16, c16), t = timed(lambda: ref16(nxt, c16))
            got, t2 = timed(lambda: session.decode(nxt))
            errs16.append(rel(got, w16))
            errs32.append(rel(got, w32))
            ts.append(t2)
            te.append(t)
            nxt = w32[:, -1:].argmax(-1)
        row.update(decode_vs_bf16_max=max(errs16), decode_vs_fp32_max=max(errs32),
                   decode_ms_median=sorted(ts)[len(ts) // 2] * 1e3, eager_decode_ms_median=sorted(te)[len(te) // 2] * 1e3)
        results[f"batch{batch}"] = row
    print(json.dumps(results, indent=1))
    Path(a.out, "gpu_artifact_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
