"""Inputs of the H200 check of TVM's CUDA kernels (`benchmarks/gpu_tvm_check.py`), made on a CPU machine.

Lowers k3.1-pro-tiny (f32) for `--target h200 --backend tvm`, decode and prefill; writes to DIR: `cuda.cu` and
`cuda.launch.json` (the TVM backend's CUDA files for every kernel group of both entries), `cases.pt` (each group's
inputs and the reference interpreter's outputs at sizes B=2, T=1 / 8, L=20: the DSA top-16 path) and the Triton
modules of the same groups (`triton/<name>.py`, for the time comparison).

    PYTHONPATH=$PWD python benchmarks/make_gpu_tvm_check.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from k3c.codegen import triton as triton_codegen
from k3c.codegen import tvm as tvm_codegen
from k3c.codegen.tvm.build import cuda_source
from k3c.context import CompileContext
from k3c.frontend import build_meta_model, import_model
from k3c.ir.interp import interpret
from k3c.ir.kernels import KernelGroup, kernel_groups
from k3c.passes.pipeline import random_inputs, run_pipeline
from models.config import K3Config


def main(out: Path) -> None:
    (out / "triton").mkdir(parents=True, exist_ok=True)
    model = build_meta_model(K3Config.from_pretrained("k3.1-pro-tiny")).cast_(torch.float32)
    groups, cases = [], []
    for entry, T in (("decode", 1), ("prefill", 8)):
        ctx = CompileContext(target="h200", backend="tvm", max_batch=2, max_seq=64, max_prefill=16).resolve()
        g, _ = run_pipeline(import_model(model, entry), ctx=ctx.for_entry(entry), verify="end")
        grs = [gr for gr in kernel_groups(g) if gr.backend == "tvm"]
        sizes = {"B": 2, "T": T, "L": 20}
        ins, params = random_inputs(g, sizes, seed=0)
        seen = {}

        def trace(node, args, outs):
            for v, t in list(zip(node.inputs, args)) + list(zip(node.outputs, outs)):
                seen.setdefault(v, t.clone())

        interpret(g, ins, params, bindings=sizes, trace=trace)
        for gr in grs:
            cases.append({"name": gr.name, "kind": gr.kind, "sizes": sizes,
                          "inputs": [seen[v].contiguous() for v in gr.inputs],
                          "want": [seen[v].contiguous() for v in gr.outputs],
                          "inplace": {1: 12, 2: 13} if gr.kind == "kda_fused" else {}})
            same = KernelGroup(gr.name, "triton", gr.kind, gr.nodes, gr.inputs, gr.outputs)
            (out / "triton" / f"{gr.name}.py").write_text(triton_codegen.emit(same))
        groups += grs
    funcs, symbol_of = tvm_codegen.emit_all(groups, "cuda")
    for c in cases:
        c["symbol"] = symbol_of[c["name"]]
    for rel, data in cuda_source(funcs).items():
        (out / rel).write_bytes(data)
    torch.save(cases, out / "cases.pt")
    print(f"{len(cases)} groups, {len(funcs)} TVM functions -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
