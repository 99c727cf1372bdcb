"""On a GPU: compile TVM's CUDA C for k3.1-pro-tiny (made by `make_gpu_tvm_check.py`), launch every kernel group
with torch tensors, compare with the reference interpreter's outputs (f32: max relative ≤ 1e-4), and time each
kind against the Triton kernel of the same group (CUDA events, median of 50 launches).

The kernels are compiled with nvcc to a cubin (sm_90) and launched through CuPy's RawModule with the grid, block
and arguments that TVM's host code would pass (`cuda.launch.json`); torch tensors cross by DLPack.

    python benchmarks/gpu_tvm_check.py DIR        # writes DIR/../results (or $OUT) gpu_tvm_check.json
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import cupy
import numpy as np
import torch


def _eval(expr: str, sizes: dict) -> int:
    return int(eval(expr, {"__builtins__": {}}, {f"s_{k}": v for k, v in sizes.items()}))  # noqa: S307 (own file)


def main(d: Path) -> None:
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-std=c++17", str(d / "cuda.cu"), "-o",
                    str(d / "cuda.cubin")], check=True)
    mod = cupy.RawModule(path=str(d / "cuda.cubin"))
    launches = json.loads((d / "cuda.launch.json").read_text())
    cases = torch.load(d / "cases.pt")
    fns = {}

    def run_tvm(case, ins, outs):
        info = launches[case["symbol"]]
        bufs = dict(zip(info["params"], ins + outs))
        for name, (n, dt) in info["workspaces"].items():
            bufs[name] = torch.empty(_eval(n, case["sizes"]), dtype=getattr(torch, dt), device="cuda")
        for k in info["kernels"]:
            fn = fns.get(k["name"]) or fns.setdefault(k["name"], mod.get_function(k["name"]))
            args = [cupy.from_dlpack(bufs[v]) if kind == "buffer" else np.int64(_eval(v, case["sizes"]))
                    for kind, v in k["args"]]
            fn((_eval(k["grid"], case["sizes"]),), (k["block"],), tuple(args))

    def tensors(case):
        ins = [t.cuda() for t in case["inputs"]]
        outs = [ins[case["inplace"][i]] if i in case["inplace"] else
                torch.full_like(w.cuda(), float("nan") if w.dtype.is_floating_point else 12345)
                for i, w in enumerate(case["want"])]
        return ins, outs

    worst, times = defaultdict(float), defaultdict(lambda: {"tvm": [], "triton": []})
    for case in cases:
        ins, outs = tensors(case)
        run_tvm(case, ins, outs)
        torch.cuda.synchronize()
        for got, want in zip(outs, case["want"]):
            got = got.cpu()
            if want.dtype.is_floating_point:
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            else:
                err = 0.0 if torch.equal(got, want) else float("inf")
            worst[case["kind"]] = max(worst[case["kind"]], err)
        spec = importlib.util.spec_from_file_location(case["name"], d / "triton" / f"{case['name']}.py")
        tri = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tri)
        for which, fn in (("tvm", lambda: run_tvm(case, ins, outs)),
                          ("triton", lambda: tri.launch(ins, outs, case["sizes"]))):
            fn()
            ts = []
            for _ in range(50):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            times[case["kind"]][which].append(statistics.median(ts))
    res = {"max_rel_err": dict(worst), "us_per_launch": {k: {w: statistics.median(v) for w, v in t.items()}
                                                        for k, t in times.items()},
           "launches": {k: len(t["tvm"]) for k, t in times.items()}, "device": torch.cuda.get_device_name()}
    out = Path(os.environ.get("OUT", d))
    (out / "gpu_tvm_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    ok = all(e <= 1e-4 for e in worst.values())
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
