"""TVM's CUDA kernels, checked without a GPU: the launch table `cuda_source` derives from TVM's host code (grid,
block, argument types, scratch buffers) for the GPU schedules of k3-tiny's decode step (rowwise: a block per row;
moe_experts: a warp per output, two launches; kda_fused: a block per (b, h) of head_dim threads), the size
expressions the runtime evaluates, and NVRTC compiling the CUDA C (when cuda-python and the CUDA headers are
installed). Running them is the GPU test `tests/runtime/test_tvm_cuda.py`."""

from __future__ import annotations

import json

import pytest

from k3c.codegen import tvm as tvm_codegen
from k3c.codegen.tvm.build import cuda_source, kernel_param_types
from k3c.codegen.tvm.script import row_threads
from k3c.context import CompileContext
from k3c.frontend import build_meta_model, import_model
from k3c.ir.kernels import kernel_groups
from k3c.passes.pipeline import run_pipeline
from k3c.runtime.launchers.tvm_cuda import size_expr
from models.config import K3Config

SIZES = {"B": 3, "T": 1, "L": 17}


@pytest.fixture(scope="module")
def built():
    """(first group of each of rowwise / moe_experts / kda_fused in k3-tiny's f32 decode, cuda_source files)."""
    ctx = CompileContext(target="h200", backend="tvm", dtype="f32", max_batch=3, max_seq=64,
                         max_prefill=16).resolve().for_entry("decode")
    g, _ = run_pipeline(import_model(build_meta_model(K3Config.from_pretrained("k3-tiny")), "decode"), ctx=ctx)
    first = {}
    for gr in kernel_groups(g):
        if gr.kind in ("rowwise", "moe_experts", "kda_fused") and gr.backend == "tvm":
            first.setdefault(gr.kind, gr)
    funcs, symbol_of = tvm_codegen.emit_all(list(first.values()), "cuda")
    return first, symbol_of, cuda_source(funcs)


def _table(built, kind):
    first, symbol_of, files = built
    return first[kind], json.loads(files["cuda.launch.json"])[symbol_of[first[kind].name]]


def test_rowwise_runs_a_block_per_row(built):
    group, info = _table(built, "rowwise")
    x = group.nodes[0].inputs[0]
    (k,) = info["kernels"]
    rows = 1
    for d in x.type.concrete_shape(SIZES)[:-1]:
        rows *= d
    assert [size_expr(e)(SIZES) for e in k["grid"]] == [rows, 1, 1]
    assert k["block"] == [row_threads(x.type.shape[-1]), 1, 1] and info["workspaces"] == {}
    assert {a for kind, a in k["args"] if kind == "ptr"} == set(info["params"])  # every tensor, by name


def test_moe_experts_runs_a_warp_per_output(built):
    group, info = _table(built, "moe_experts")
    z, _, ids, w1 = group.nodes[0].inputs[:4]
    N, k = SIZES["B"], ids.type.shape[1]
    E, I, D = w1.type.shape[0], w1.type.shape[1], z.type.shape[1]
    up, down = info["kernels"]
    assert up["block"] == down["block"] == [32, 4, 1]
    assert size_expr(up["grid"][0])(SIZES) == -(-N * k * I // 4) and size_expr(down["grid"][0])(SIZES) == -(-N * D // 4)
    (n, dtype), = info["workspaces"].values()
    assert size_expr(n)(SIZES) == N * k * I and dtype == "float32" and E > k


def test_kda_runs_a_block_per_head(built):
    group, info = _table(built, "kda_fused")
    a = group.nodes[0].attrs
    (k,) = info["kernels"]
    assert size_expr(k["grid"][0])(SIZES) == SIZES["B"] * a["heads"] and k["block"] == [a["head_dim"], 1, 1]


def test_param_types_follow_the_cuda_source(built):
    src = built[2]["cuda.cu"].decode()
    types = kernel_param_types(src)
    assert types and all(set(t) <= {"ptr", "int64", "int32", "uint32"} for t in types.values())
    table = json.loads(built[2]["cuda.launch.json"])
    for info in table.values():
        for k in info["kernels"]:
            assert [kind for kind, _ in k["args"]] == types[k["name"]]


def test_size_expressions_are_data():
    assert size_expr("((s_B * s_T) + 127) // 128")({"B": 3, "T": 100, "L": 0}) == 3
    assert size_expr("-s_L % 7")({"B": 1, "T": 1, "L": 3}) == 4
    for bad in ("__import__('os')", "s_B ** 2", "s_X", "1.5", "(lambda: 1)()"):
        with pytest.raises(ValueError):
            size_expr(bad)


def test_nvrtc_compiles_the_cuda_source(built):
    pytest.importorskip("cuda.bindings")
    from cuda.pathfinder import find_nvidia_header_directory

    from k3c.runtime.launchers.tvm_cuda import compile_cubin

    if not find_nvidia_header_directory("cccl"):
        pytest.skip("NVRTC needs the CUDA headers (cuda/std, math_constants.h)")
    cubin = compile_cubin(built[2]["cuda.cu"], "sm_90")
    assert cubin[:4] == b"\x7fELF"
    names = kernel_param_types(built[2]["cuda.cu"].decode())
    assert all(n.encode() in cubin for n in names)  # every kernel's symbol is in the binary
