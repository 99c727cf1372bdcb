"""TVM CPU kernels (k3c.codegen.tvm) against the IR ops' torch references, on every generated group of the lowered
tiny models: pointwise, rowwise, kda_fused, mla_attention (absorbed and not, dense and DSA top-k), dsa_index_topk,
attn_res_inter / _merge, moe_route, moe_experts, and the decode linears (GEMV; the prefill GEMMs stay torch calls).

One library is built for the whole session from the kernel groups of three lowered graphs (k3.1-pro-tiny prefill
and kimi-linear-tiny prefill in f32, k3-tiny decode in bf16); the reference interpreter runs each graph on random
inputs and every group is launched through the runtime's TVM launcher on the values the interpreter saw, with
NaN-filled outputs (so every element must be written). f32: max|got − want| / max|want| ≤ 1e-5; bf16 ≤ 1e-2 (the
references round intermediates to bf16, the kernels keep fp32 until the store); integers exactly.
"""

import pytest
import torch

from k3c.codegen import tvm as tvm_codegen
from k3c.codegen.tvm.build import build_cpu
from k3c.context import CompileContext
from k3c.frontend import build_meta_model, import_model
from k3c.ir.interp import interpret
from k3c.ir.kernels import kernel_groups
from k3c.ir.types import torch_dtype
from k3c.passes.pipeline import random_inputs, run_pipeline
from k3c.runtime.launchers.tvm import TvmLibrary, launch
from models.config import K3Config

GRAPHS = [("k3.1-pro-tiny", "prefill", torch.float32), ("kimi-linear-tiny", "prefill", torch.float32),
          ("k3-tiny", "decode", torch.bfloat16)]
KINDS = {"pointwise", "rowwise", "kda_fused", "mla_attention", "dsa_index_topk", "attn_res_inter",
         "attn_res_merge", "moe_route", "moe_experts", "linear"}


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(graphs [(graph, groups, dtype, entry)], library, {group name: symbol}, {symbol: TIR text}, files)."""
    graphs = []
    for preset, entry, dtype in GRAPHS:
        ctx = CompileContext(target="cpu-x86-64", dtype="f32" if dtype == torch.float32 else "bf16", max_batch=3,
                             max_seq=64, max_prefill=16).resolve().for_entry(entry)
        g = import_model(build_meta_model(K3Config.from_pretrained(preset)).cast_(dtype), entry)
        g, _ = run_pipeline(g, ctx=ctx, verify="end")
        graphs.append((g, [gr for gr in kernel_groups(g) if gr.kind in KINDS and gr.backend == "tvm"], dtype, entry))
    groups = [gr for _, grs, _, _ in graphs for gr in grs]
    for (_, grs, _, _), (preset, entry, _) in zip(graphs, GRAPHS):
        for gr in grs:
            gr.name = f"{preset}_{gr.name}".replace("-", "_").replace(".", "_")
    funcs, symbol_of = tvm_codegen.emit_all(groups, "cpu")
    files = build_cpu(funcs)
    path = tmp_path_factory.mktemp("tvm") / "cpu.so"
    path.write_bytes(files["cpu.so"])
    return graphs, TvmLibrary(path), symbol_of, funcs, files


def test_every_kind_is_covered(built):
    graphs, _, symbol_of, funcs, _ = built
    assert {gr.kind for _, grs, _, _ in graphs for gr in grs} == KINDS
    assert len(funcs) < len(symbol_of) / 4, "identical layers must share their PrimFunc"


def _run_graph(graph, groups, dtype, lib, symbol_of, sizes):
    ins, params = random_inputs(graph, sizes, seed=1)
    seen = {}

    def trace(node, args, outs):
        for v, t in list(zip(node.inputs, args)) + list(zip(node.outputs, outs)):
            seen.setdefault(v, t.clone())

    interpret(graph, ins, params, bindings=sizes, trace=trace)
    # bf16: two roundings apart (2^-7 each; e.g. the experts' bf16 intermediate h rounded where the reference does
    # not hold it in registers), relative to the output's largest magnitude
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(torch.bfloat16).eps
    checked = set()
    for gr in groups:
        inputs = [seen[v].contiguous() for v in gr.inputs]
        outs = []
        for i, v in enumerate(gr.outputs):
            if gr.kind == "kda_fused" and i > 0:  # the states are updated in place: output i is input 11 + i
                outs.append(inputs[11 + i])
                continue
            dt = torch_dtype(v.type.dtype)
            outs.append(torch.full(v.type.concrete_shape(sizes), float("nan") if dt.is_floating_point else 12345,
                                   dtype=dt))
        launch(lib.function(symbol_of[gr.name]), inputs, outs, sizes)
        for v, got in zip(gr.outputs, outs):
            want = seen[v]
            assert got.dtype == want.dtype, gr.name
            if want.dtype.is_floating_point:
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
                assert err <= tol, f"{gr.name} ({gr.kind}) %{v.name}: max relative error {err:.3g}"
            else:
                assert torch.equal(got, want), f"{gr.name} ({gr.kind}) %{v.name}:\n{got}\n!=\n{want}"
        checked.add(gr.kind)
    return checked


@pytest.mark.parametrize("L", [4, 20], ids=["dense", "dsa_topk"])
def test_kernels_match_references(built, L):
    """L = 4: every key count S = L + T ≤ 16 (the DSA guard's dense path); L = 20: attention over the top-16."""
    graphs, lib, symbol_of, _, _ = built
    checked = set()
    for graph, groups, dtype, entry in graphs:
        sizes = {"B": 2, "T": 3 if entry == "prefill" else 1, "L": L}
        checked |= _run_graph(graph, groups, dtype, lib, symbol_of, sizes)
    assert checked == KINDS


def test_build_is_deterministic(built):
    *_, funcs, files = built
    again = build_cpu(dict(list(funcs.items())[:3]))
    once = build_cpu(dict(list(funcs.items())[:3]))
    assert again == once


def test_aarch64_object(built):
    """The same kernels cross-compile for aarch64 to one ELF object (e_machine 183 = EM_AARCH64)."""
    *_, funcs, _ = built
    files = build_cpu(dict(list(funcs.items())[:3]), arch="aarch64")
    obj = files["cpu-aarch64.o"]
    assert obj[:4] == b"\x7fELF" and int.from_bytes(obj[18:20], "little") == 183
    assert files["cpu-aarch64.tir.txt"].startswith(b"#")


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_mxfp4(act, tmp_path):
    """MXFP4 experts (every byte value, scales 2^-3 .. 2^2; k3c.ir.formats) decoded per element in the CPU kernel:
    equal to the reference's dequantize-then-GEMM in fp32. N = 5 tokens of top-2 over 4 experts, one unused slot,
    expert 2 unchosen; D = 64, I = 96 (several 32-value groups per row in both GEMMs)."""
    from k3c.ir.graph import Graph
    from k3c.ir.kernels import KernelGroup
    from k3c.ir.ops import get_op
    from k3c.ir.types import TensorType

    gen = torch.Generator().manual_seed(7)
    N, k, E, D, I = 5, 2, 4, 64, 96
    mx = [(torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, generator=gen),
           torch.randint(124, 130, (E, R, C // 32), dtype=torch.uint8, generator=gen))
          for R, C in ((I, D), (I, D), (D, I))]
    tensors = [torch.randn(N, D, generator=gen) * 0.1, torch.rand(N, k, generator=gen),
               torch.tensor([[0, 1], [1, 3], [3, 0], [1, -1], [0, 3]])] + [w for w, _ in mx] + [s for _, s in mx]
    g = Graph()
    dtype = {torch.float32: "f32", torch.int64: "i64", torch.uint8: "u8"}
    vals = [g.add_input(f"in{i}", TensorType(tuple(t.shape), dtype[t.dtype])) for i, t in enumerate(tensors)]
    outs = g.add_node("moe_experts", vals, {"act": act, "weight_format": "mxfp4"})
    group = KernelGroup(f"mx_{act}", "tvm", "moe_experts", [g.nodes[0]], vals, outs)
    funcs, symbol_of = tvm_codegen.emit_all([group], "cpu")
    (tmp_path / "mx.so").write_bytes(build_cpu(funcs)["cpu.so"])
    y = torch.full((N, D), float("nan"))
    launch(TvmLibrary(tmp_path / "mx.so").function(symbol_of[group.name]), tensors, [y], {"B": 1, "T": 1, "L": 1})
    node = g.nodes[0]
    (want,) = get_op("moe_experts").ref(node.attrs, *tensors)
    assert ((y - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("N, K, bias", [(24, 40, True), (6, 13, False)], ids=["lanes_bias", "serial"])
def test_linear_gemv(N, K, bias, tmp_path):
    """The decode GEMV (`k3c.codegen.tvm.linear`) at B rows of x [B, 1, K]: equal to F.linear in fp32, with the
    bias, at several B from one build. K = 40: 8-lane partial sums, 8 features per task; K = 13, N = 6: the serial
    sum, 2 features per task."""
    import torch.nn.functional as F

    from k3c.codegen.tvm.linear import is_gemv
    from k3c.ir.graph import Graph
    from k3c.ir.kernels import KernelGroup
    from k3c.ir.types import TensorType, dim

    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    g = Graph()
    vals = [g.add_input("x", TensorType((dim("B"), 1, K), "f32")), g.add_input("w", TensorType((N, K), "f32"))]
    vals += [g.add_input("b", TensorType((N,), "f32"))] if bias else []
    outs = g.add_node("linear", vals)
    assert is_gemv(g.nodes[0])
    group = KernelGroup("gemv", "tvm", "linear", [g.nodes[0]], vals, outs)
    funcs, symbol_of = tvm_codegen.emit_all([group], "cpu")
    (tmp_path / "gemv.so").write_bytes(build_cpu(funcs)["cpu.so"])
    fn = TvmLibrary(tmp_path / "gemv.so").function(symbol_of[group.name])
    for B in (1, 3):
        x = torch.randn(B, 1, K, generator=gen)
        y = torch.full((B, 1, N), float("nan"))
        launch(fn, [x, w] + ([b] if bias else []), [y], {"B": B, "T": 1, "L": 0})
        want = F.linear(x, w, b if bias else None)
        assert ((y - want).abs().max() / want.abs().max()).item() <= 1e-6


def test_gemm_stays_a_library_call():
    """A linear whose rows grow with T (prefill) is no GEMV: the TVM backend leaves it to torch."""
    from k3c.codegen.tvm.linear import is_gemv
    from k3c.ir.graph import Graph
    from k3c.ir.types import TensorType, dim

    g = Graph()
    x = g.add_input("x", TensorType((dim("B"), dim("T"), 16), "f32"))
    g.add_node("linear", [x, g.add_input("w", TensorType((8, 16), "f32"))])
    assert not is_gemv(g.nodes[0])
