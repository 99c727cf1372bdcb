"""TVM vs Triton CUDA kernels, per kernel kind, at K3.1 Pro's full width (hidden 7168) on one GPU.

Two steps, since the GPU machine has no apache-tvm:

    PYTHONPATH=$PWD python benchmarks/bench_tvm_gpu.py prepare DIR     # CPU, with the compiler: the kernels
    python benchmarks/bench_tvm_gpu.py run DIR [--out results.json] [--kinds a,b]   # GPU: NVRTC, time, a table

`prepare` lowers K3.1 Pro's decode step (bf16, MXFP4 experts) for `--target h200 --backend tvm`, takes per kind
TVM generates the kernel group that touches the most elements (at B = 16, L = 4096), and writes their TVM CUDA C
(`cuda.cu`, `cuda.launch.json`), the Triton module of the same group (`triton/<name>.py`) and the groups' tensors
(`cases.json`: shapes over B, T, L, dtypes). `run` compiles the CUDA C with NVRTC and launches it through the
runtime's `CudaKernels`, the Triton modules through their `launch`, on the same random inputs (ids and DSA indices
in range, MXFP4 scales near 1) at decode sizes B = 1 and 16, T = 1, L = 4096 (the DSA layers attend to their
top-2048 keys), and reports each kind's median time (`triton.testing.do_bench`: CUDA events, L2 flushed between runs) and the largest relative
difference between the two backends' outputs. GEMMs are torch (cuBLAS) calls under both backends: not compared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

L_CONTEXT, BATCHES = 4096, (1, 16)


def prepare(out: Path) -> None:
    import torch

    from k3c.codegen import triton as triton_codegen
    from k3c.codegen import tvm as tvm_codegen
    from k3c.codegen.tvm.build import cuda_source
    from k3c.codegen.tvm.script import dim_expr
    from k3c.context import CompileContext
    from k3c.frontend import build_meta_model, import_model
    from k3c.ir.kernels import KernelGroup, kernel_groups
    from k3c.passes.pipeline import run_pipeline
    from models.config import K3Config

    (out / "triton").mkdir(parents=True, exist_ok=True)
    model = build_meta_model(K3Config.from_pretrained("k3.1-pro")).cast_(torch.bfloat16)
    ctx = CompileContext(target="h200", backend="tvm", dtype="bf16", experts_dtype="mxfp4",
                         max_batch=max(BATCHES), max_seq=L_CONTEXT + 1, max_prefill=64).resolve()
    g, _ = run_pipeline(import_model(model, "decode"), ctx=ctx.for_entry("decode"))
    sizes = {"B": max(BATCHES), "T": 1, "L": L_CONTEXT}
    moved = lambda gr: sum(math.prod(v.type.concrete_shape(sizes)) for v in gr.inputs + gr.outputs)  # noqa: E731
    heaviest = {}  # per kind, the group that touches the most elements
    for gr in kernel_groups(g):
        if gr.backend == "tvm" and (gr.kind not in heaviest or moved(gr) > moved(heaviest[gr.kind])):
            heaviest[gr.kind] = gr
    groups = [heaviest[k] for k in sorted(heaviest)]
    funcs, symbol_of = tvm_codegen.emit_all(groups, "cuda")
    for rel, data in cuda_source(funcs).items():
        (out / rel).write_bytes(data)
    spec = lambda v: {"shape": [dim_expr(d) for d in v.type.shape], "dtype": v.type.dtype}  # noqa: E731
    cases = []
    for gr in groups:
        same = KernelGroup(gr.name, "triton", gr.kind, gr.nodes, gr.inputs, gr.outputs)
        (out / "triton" / f"{gr.name}.py").write_text(triton_codegen.emit(same))
        cases.append({"name": gr.name, "kind": gr.kind, "symbol": symbol_of[gr.name],
                      "inputs": [spec(v) for v in gr.inputs], "outputs": [spec(v) for v in gr.outputs]})
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    print(f"{len(cases)} kinds: {', '.join(c['kind'] for c in cases)} -> {out}")


def _inputs(case: dict, sizes: dict, gen):
    """Random inputs of one case (module docstring), on the GPU."""
    import torch

    from k3c.runtime.launchers.tvm_cuda import size_expr

    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i64": torch.int64,
          "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool}
    shapes = [[size_expr(d)(sizes) for d in s["shape"]] for s in case["inputs"]]
    out = []
    for i, (s, shape) in enumerate(zip(case["inputs"], shapes)):
        if s["dtype"] in ("i64", "i32"):
            if case["kind"] == "moe_experts":   # expert ids < E (w1's rows)
                hi = shapes[3][0]
            elif case["kind"] == "mla_attention":  # DSA positions < the key count
                hi = shapes[1][1]
            else:
                hi = 2
            t = torch.randint(0, hi, shape, generator=gen, device="cuda", dtype=dt[s["dtype"]])
        elif s["dtype"] == "u8":  # MXFP4 codes; their E8M0 scales (the later u8 inputs, [.., cols/32]) near 2^0
            scale = case["kind"] == "moe_experts" and i >= 6
            t = torch.randint(120, 128, shape, generator=gen, device="cuda", dtype=torch.uint8) if scale else \
                torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.uint8)
        elif s["dtype"] == "bool":
            t = torch.rand(shape, generator=gen, device="cuda") < 0.5
        else:
            t = (torch.randn(shape, generator=gen, device="cuda") * 0.5).to(dt[s["dtype"]])
        out.append(t)
    outs = [torch.zeros([size_expr(d)(sizes) for d in s["shape"]], device="cuda", dtype=dt[s["dtype"]])
            for s in case["outputs"]]
    return out, outs


def run(root: Path, out_json: Path | None, kinds: set[str] | None = None) -> None:
    import importlib.util

    import torch
    from triton.testing import do_bench

    from k3c.runtime.launchers.tvm_cuda import CudaKernels, compile_cubin

    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    kernels = CudaKernels(compile_cubin((root / "cuda.cu").read_bytes(), f"sm_{major}{minor}"),
                          json.loads((root / "cuda.launch.json").read_text()), dev)
    cases = [c for c in json.loads((root / "cases.json").read_text()) if kinds is None or c["kind"] in kinds]
    rows = []
    for case in cases:
        spec = importlib.util.spec_from_file_location(case["name"], root / "triton" / f"{case['name']}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for B in BATCHES:
            sizes = {"B": B, "T": 1, "L": L_CONTEXT}
            ins, outs_tvm = _inputs(case, sizes, torch.Generator(device="cuda").manual_seed(0))
            outs_tri = [torch.zeros_like(o) for o in outs_tvm]  # (states go to fresh outputs: inputs stay)
            kernels.run(case["symbol"], ins, outs_tvm, sizes)
            mod.launch(ins, outs_tri, sizes)
            torch.cuda.synchronize()
            diff = max((float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                        for a, b in zip(outs_tvm, outs_tri) if a.is_floating_point()), default=0.0)
            t_tvm = do_bench(lambda: kernels.run(case["symbol"], ins, outs_tvm, sizes), warmup=25, rep=100)  # noqa
            t_tri = do_bench(lambda: mod.launch(ins, outs_tri, sizes), warmup=25, rep=100)  # noqa: B023
            rows.append({"kind": case["kind"], "B": B, "tvm_us": t_tvm * 1e3, "triton_us": t_tri * 1e3,
                         "rel_diff": diff})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| kind | B | TVM µs | Triton µs | TVM / Triton | max rel diff |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['B']} | {r['tvm_us']:.1f} | {r['triton_us']:.1f} | "
              f"{r['tvm_us'] / r['triton_us']:.2f} | {r['rel_diff']:.1e} |")
    if out_json:
        out_json.write_text(json.dumps({"L": L_CONTEXT, "device": torch.cuda.get_device_name(), "rows": rows},
                                       indent=1))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="run: also write the rows as JSON here")
    ap.add_argument("--kinds", default=None, help="run: only these kernel kinds (comma-separated)")
    a = ap.parse_args(argv)
    prepare(a.dir) if a.step == "prepare" else run(a.dir, a.out, set(a.kinds.split(",")) if a.kinds else None)


if __name__ == "__main__":
    main(sys.argv[1:])
