"""Decode-sized small kernels on the GPU, CUDA-graph medians (`triton.testing.do_bench_cudagraph`): the MoE tile
schedule (`moe_schedule`: one launch up to SCHEDULE_KERNEL_MAX_ROWS rows, else torch) for E = 32 / 896 experts and
N tokens choosing 16, and `attn_res_merge` for R rows of D = 7168 (Q = 8 pseudo-queries). Prints microseconds and
writes $OUT/small_kernels.json (milliseconds). Usage (device tool, repository root):

    PYTHONPATH=$PWD python3 benchmarks/bench_small_kernels.py
"""

import json
import os

import torch
from triton.testing import do_bench_cudagraph

from k3c.codegen.triton.attn_res import launch_attn_res_merge
from k3c.codegen.triton.moe import moe_schedule


def main():
    res = {}
    for E in (32, 896):
        for N in (1, 16, 64, 128):
            ids = torch.stack([torch.randperm(E)[:16] for _ in range(N)]).cuda()
            res[f"moe_schedule E{E} N{N}"] = do_bench_cudagraph(lambda: moe_schedule(ids, E, 16), rep=50)
    for R in (1, 16, 64):
        Q, D = 8, 7168
        o, lse = torch.randn(Q, R, 1, D, device="cuda"), torch.randn(Q, R, 1, device="cuda")
        x = torch.randn(R, 1, D, device="cuda", dtype=torch.bfloat16)
        q, h = torch.randn(Q, D, device="cuda") * 0.01, torch.empty_like(x)
        res[f"attn_res_merge R{R}"] = do_bench_cudagraph(
            lambda: launch_attn_res_merge(o, lse, x, q, h, index=3, eps=1e-5), rep=50)
    for k, v in res.items():
        print(f"{k:30s} {v * 1000:8.2f} us")
    with open(os.path.join(os.environ.get("OUT", "."), "small_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
