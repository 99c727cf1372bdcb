"""Run compiled artifacts on the GPU and compare them with `models/k3.py` eager (bf16 and fp32) and torch.compile.

Usage (on the H200, through the device tool; the artifacts and checkpoint are built on CPU first by
`make_gpu_check_inputs.py`):
    python benchmarks/gpu_artifact_check.py --ckpt build/gpu/ckpt --artifact build/gpu/art \
        [--artifact32 build/gpu/art32] [--torch-compile] --out $OUT

With --artifact-bf16-experts (a build of the same MXFP4 checkpoint with `--experts-dtype bf16`) the MXFP4 and the
dequantized-expert artifacts run side by side. Every runner sees the same tokens: a random prompt [B,64] then 32
teacher-forced decode steps (the fp32 eager greedy
continuation), batch 1 and 3. Runners: eager fp32, eager bf16, k3c (the artifact's dtype; with and without CUDA
graphs for decode), k3c f32 (optional), and
torch.compile of eager bf16 (optional: a second bf16 implementation of the same model, the yardstick for how far two
correct bf16 implementations drift apart on this checkpoint). For each compared pair, over all prefill + decode calls:
- `max_rel`: max |a - b| / max |b| (inf-norm relative error of the whole call), the worst call;
- `err_ratio`: rms(a - b) / rms(b) (FLA's `get_err_ratio`), the worst call;
- per-position max |a - b| / max |b| over the vocab: median and p99 over positions; greedy-token agreement.
Writes OUT/gpu_artifact_check.json and prints it. Times: per-call wall seconds, CUDA synchronised.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import k3c
from models.k3 import load_checkpoint


class Eager:
    """models/k3.py eager (optionally torch.compile'd) with its cache, behind the runtime's prefill/decode API."""

    def __init__(self, model, compiled: bool = False):
        self.model, self.fn = model, torch.compile(model, dynamic=True) if compiled else model
        self.cache = None

    def reset(self):
        self.cache = None

    @torch.no_grad()
    def prefill(self, tokens):  # the last position's logits, as the runtime's prefill returns them
        logits, self.cache = self.fn(tokens, self.cache)
        return logits[:, -1:].float()

    decode = prefill


def run(runner, prompt, steps) -> tuple[list[torch.Tensor], list[float]]:
    """Logits of every call (prefill, then one per decode step) and per-call seconds."""
    runner.reset()
    outs, secs = [], []
    for i, tok in enumerate([prompt, *steps]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append((runner.prefill if i == 0 else runner.decode)(tok).float())
        torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
    return outs, secs


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    """The metrics of the module docstring for two runs of the same calls."""
    max_rel = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
    ratio = max(float((g - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) for g, w in zip(got, want))
    g = torch.cat([x.flatten(0, -2) for x in got])
    w = torch.cat([x.flatten(0, -2) for x in want])
    pos = (g - w).abs().amax(-1) / w.abs().amax(-1)
    q = torch.quantile(pos, torch.tensor([0.5, 0.99], device=pos.device)).tolist()
    return {"max_rel": max_rel, "err_ratio": ratio, "position_median": q[0], "position_p99": q[1],
            "argmax_agree": float((g.argmax(-1) == w.argmax(-1)).float().mean())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--artifact32", default=None, help="an f32 artifact of the same checkpoint (exactness check)")
    ap.add_argument("--artifact-bf16-experts", default=None,
                    help="a build of the same MXFP4 checkpoint with --experts-dtype bf16 (side-by-side speed)")
    ap.add_argument("--torch-compile", action="store_true", help="add torch.compile(eager bf16) as a runner")
    ap.add_argument("--out", default=".")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    ref32 = Eager(load_checkpoint(a.ckpt, torch.float32, "cuda").eval())
    runners = {"eager_fp32": ref32, "eager_bf16": Eager(load_checkpoint(a.ckpt, torch.bfloat16, "cuda").eval()),
               "k3c": k3c.load(a.artifact, "cuda"), "k3c_no_cuda_graphs": k3c.load(a.artifact, "cuda", cuda_graphs=False)}
    if a.artifact_bf16_experts:
        runners["k3c_bf16_experts"] = k3c.load(a.artifact_bf16_experts, "cuda")
    if a.artifact32:
        runners["k3c_f32"] = k3c.load(a.artifact32, "cuda")
    if a.torch_compile:
        runners["torch_compile_bf16"] = Eager(runners["eager_bf16"].model, compiled=True)
    pairs = [("k3c", "eager_bf16"), ("k3c", "k3c_no_cuda_graphs"), ("k3c", "eager_fp32"), ("eager_bf16", "eager_fp32"),
             ("k3c_f32", "eager_fp32"), ("torch_compile_bf16", "eager_bf16"), ("torch_compile_bf16", "eager_fp32"),
             ("k3c", "k3c_bf16_experts"), ("k3c_bf16_experts", "eager_bf16")]
    vocab = ref32.model.config.vocab_size
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "k3c_dtype": runners["k3c"].manifest["extra"]["dtype"],
               "k3c_experts_dtype": runners["k3c"].manifest["extra"].get("experts_dtype")}
    for batch in (1, 3):
        prompt = torch.randint(0, vocab, (batch, a.prompt), generator=torch.Generator().manual_seed(0)).cuda()
        ref32.reset()  # the teacher-forced continuation: fp32 eager greedy
        steps, logits = [], ref32.prefill(prompt)
        for _ in range(a.steps):
            steps.append(logits[:, -1:].argmax(-1))
            logits = ref32.decode(steps[-1])
        outs, times = {}, {}
        for name, r in runners.items():
            try:
                run(r, prompt, steps)  # warm-up: JIT compilation of kernels / graphs
                outs[name], secs = run(r, prompt, steps)
            except Exception as e:  # a runner that fails (e.g. torch.compile) is reported, not fatal
                times[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            times[name] = {"prefill_ms": secs[0] * 1e3, "decode_ms_median": sorted(secs[1:])[len(secs) // 2] * 1e3}
        results[f"batch{batch}"] = {"times": times, **{f"{x}_vs_{y}": compare(outs[x], outs[y])
                                                       for x, y in pairs if x in outs and y in outs}}
    print(json.dumps(results, indent=1))
    Path(a.out, "gpu_artifact_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
