"""Pass `form_kernels`: Before/Expected grouping on small graphs, group counts on k3-tiny decode, structural
invariants of the groups on every tiny preset (prefill and decode), determinism, and an unchanged computation.

Also holds `formed(model, mode)`, the tiny graphs after cleanup + model + form_kernels, cached per session and
shared with test_pointwise_rowwise.py.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from k3c.codegen.backend import Backend
from k3c.context import CompileContext
from k3c.errors import IRError, UnsupportedError
from k3c.frontend import import_model
from k3c.ir import Graph, TensorType
from k3c.ir.interp import interpret
from k3c.ir.kernels import KernelSpan, kernel_groups
from k3c.passes.common import is_elementwise, is_row_op, same_shape
from k3c.passes.form_kernels import MODEL_OPS, VIEW_OPS, form_kernels
from k3c.passes.pipeline import random_inputs, run_pipeline

PRESETS = [("k3-tiny", "decode"), ("k3-tiny", "prefill"), ("kimi-linear-tiny", "decode"),
           ("kimi-linear-tiny", "prefill")]
FORM = {"kernels": ["form_kernels"]}
CTX = CompileContext().resolve()  # h200: triton, library, view


@functools.lru_cache(maxsize=None)
def modeled(model: str, mode: str) -> Graph:
    """The tiny preset after the cleanup and model phases (cached; callers must copy before changing it)."""
    g, _ = run_pipeline(import_model(model, mode), ["cleanup", "model"])
    return g


@functools.lru_cache(maxsize=None)
def formed(model: str, mode: str) -> Graph:
    """`modeled(model, mode)` after form_kernels (cached; do not change it)."""
    g, _ = run_pipeline(modeled(model, mode), FORM)
    return g


def stamps(g: Graph) -> list[tuple[str, str, str, str]]:
    """(first output, kernel, backend, kind) per node."""
    return [(n.outputs[0].name, k.name, k.backend, k.kind) for k in kernel_groups(g) for n in k.nodes]


def grouping(g: Graph) -> list[tuple[str, list[str]]]:
    """(kind, [node ops]) per group: the shape of the grouping, for Before/Expected tests."""
    return [(k.kind, [n.op for n in k.nodes]) for k in kernel_groups(form_kernels(g, CTX))]


# ---- Before / Expected on small graphs ----------------------------------------------------------------------------
def test_rms_norm_takes_its_elementwise_epilogue_then_a_pointwise_run():
    g = Graph()
    x = g.add_input("x", TensorType(("B", "T", 64), "f32"))
    w = g.add_param("norm.weight", TensorType((64,), "f32"))
    s = g.add_param("scale", TensorType((64,), "f32"))
    h = g.add("rms_norm", x, w, eps=1e-6)
    h = g.add("mul", h, s)                        # epilogue: reads the norm, same shape
    h = g.add("add", h, x)                        # epilogue
    y = g.add("sigmoid", x)                       # same shape but reads nothing of the group: a new pointwise run
    z = g.add("mul", y, h)
    g.set_output("z", z)
    assert grouping(g) == [("rowwise", ["rms_norm", "mul", "add"]), ("pointwise", ["sigmoid", "mul"])]


def test_pointwise_runs_split_on_shape_and_on_other_ops():
    g = Graph()
    x = g.add_input("x", TensorType(("B", 8), "f32"))
    v = g.add_input("v", TensorType((8,), "f32"))
    w = g.add_param("w", TensorType((8, 8), "f32"))
    a = g.add("mul", v, scalar=2.0)               # [8]
    b = g.add("add", x, a)                        # [B, 8]: another shape, another group
    c = g.add("silu", b)
    d = g.add("linear", c, w)                     # library
    e = g.add("add", d, c)                        # pointwise again after the GEMM
    f = g.add("softmax", e, dim=0)                # not the last dim: library
    t = g.add("sum", f, dims=[-1], keepdim=True)  # rowwise reduction
    u = g.add("mul", t, scalar=0.5)               # its epilogue: [B, 1]
    r = g.add("reshape", u, shape=["B"])          # view
    g.set_output("r", r)
    assert grouping(g) == [("pointwise", ["mul"]), ("pointwise", ["add", "silu"]), ("linear", ["linear"]),
                           ("pointwise", ["add"]), ("softmax", ["softmax"]), ("rowwise", ["sum", "mul"]),
                           ("reshape", ["reshape"])]


def test_copy_is_a_view_fp8_and_int_reductions_go_to_the_library():
    g = Graph()
    x = g.add_input("x", TensorType(("B", 8), "f32"))
    i = g.add_input("i", TensorType(("B", 8), "i64"))
    c = g.add("copy", x)
    q = g.add("cast", c, to="f8e4m3")
    s = g.add("sum", i, dims=[-1])
    g.set_output("q", q)
    g.set_output("s", s)
    assert grouping(g) == [("copy", ["copy"]), ("cast", ["cast"]), ("sum", ["sum"])]


def test_names_backends_and_inputs_outputs():
    g = Graph()
    x = g.add_input("x", TensorType(("B", 4), "f32"))
    w = g.add_param("w", TensorType((4, 4), "f32"))
    a = g.add("linear", x, w, name_hint="proj")
    b = g.add("tanh", a, name_hint="t")
    c = g.add("mul", b, x, name_hint="m")
    d = g.add("add", c, scalar=1.0, name_hint="o")
    g.set_output("y", d)
    g.set_output("t", b)
    form_kernels(g, CTX)
    assert stamps(g) == [("proj", "k0000_linear", "library", "linear"), ("t", "k0001_pointwise", "triton", "pointwise"),
                         ("m", "k0001_pointwise", "triton", "pointwise"), ("o", "k0001_pointwise", "triton", "pointwise")]
    lib, pw = kernel_groups(g)
    assert [v.name for v in lib.inputs] == ["x", "w"] and [v.name for v in lib.outputs] == ["proj"]
    assert [v.name for v in pw.inputs] == ["proj", "x"]
    assert [v.name for v in pw.outputs] == ["t", "o"]  # t is a graph output; m is used only inside


def test_kernel_groups_rejects_unstamped_and_split_groups():
    g = Graph()
    x = g.add_input("x", TensorType((4,), "f32"))
    a = g.add("exp", x)
    b = g.add("log", a)
    c = g.add("neg", b)
    g.set_output("c", c)
    with pytest.raises(IRError, match="form_kernels"):
        kernel_groups(g)
    form_kernels(g, CTX)
    assert [(s.start, s.count) for s in g.kernels] == [(0, 3)]
    g.kernels = [KernelSpan("k0000_pointwise", "triton", "pointwise", 0, 1),
                 KernelSpan("k0001_pointwise", "triton", "pointwise", 2, 1)]
    with pytest.raises(IRError, match="consecutively"):
        kernel_groups(g)
    g.kernels = [KernelSpan("k0000_pointwise", "triton", "pointwise", 0, 2)]
    with pytest.raises(IRError, match="covers 2 nodes but the graph has 3"):
        kernel_groups(g)


class OnlySingles(Backend):
    """A code generator that implements pointwise groups of one node only."""

    name, generates = "singles", True

    def claims(self, kind, nodes):
        return kind == "pointwise" and len(nodes) == 1


def test_unclaimed_fusion_is_offered_node_by_node_then_as_single_ops():
    g = Graph()
    x = g.add_input("x", TensorType((4,), "f32"))
    g.set_output("y", g.add("neg", g.add("exp", x)))
    ctx = CTX.replace(backends=(OnlySingles(None), *CTX.backends[1:]))  # without triton
    form_kernels(g, ctx)
    assert [(s.backend, s.kind, s.count) for s in g.kernels] == [("singles", "pointwise", 1)] * 2
    lib_only = CTX.replace(backends=CTX.backends[1:])  # library, view: neither runs exp
    with pytest.raises(UnsupportedError, match=r"no backend implements .*exp.*library, view"):
        form_kernels(g, lib_only)


# ---- the tiny presets --------------------------------------------------------------------------------------------
def test_group_counts_k3_tiny_decode():
    g = formed("k3-tiny", "decode")
    groups = kernel_groups(g)
    counts = Counter((k.backend, k.kind) for k in groups)
    ops = Counter(n.op for n in g.nodes)
    for op in MODEL_OPS - {"attn_res_merge"}:
        assert counts[("triton", op)] == ops[op]
    # every AttnRes merge is a row launch with its norm (and, in 16 of the 20, the residual add before it)
    assert counts[("triton", "attn_res_row")] == ops["attn_res_merge"] == 20
    assert sum(k.nodes[0].op == "add" for k in groups if k.kind == "attn_res_row") == 16
    for (backend, kind), n in counts.items():
        if backend in ("library", "view"):
            assert n == ops[kind], kind
    # k3-tiny has 10 layers, each with 2 decoder norms, plus the q_a / kv_a norms of its 3 MLA layers and the
    # routed-expert norm of its 9 MoE layers, final norm: 36 rms_norm, none followed by an elementwise node; the 20
    # that read an AttnRes merge are in its row launch.
    assert ops["rms_norm"] == 36 and counts[("triton", "rowwise")] == 36 - 20
    # pointwise, each run kept apart by GEMMs / model ops / views: 10 GLU activations (1 dense + 9 shared-expert
    # MLPs, 9-node runs), 9 MoE routed + shared adds and 3 MLA output gates (sigmoid, mul); the 16 residual adds
    # joined their merge's row launch; the 20 AttnRes query scales (norm weight x projection, f32[64]) read weights
    # only: fold_params computed them.
    assert counts[("triton", "pointwise")] == 10 + 9 + 3
    assert counts[("library", "linear")] == ops["linear"] == 129
    assert sum(counts.values()) == len(groups)
    assert Counter(len(k.nodes) for k in groups if k.kind == "pointwise")[9] == 10


@pytest.mark.parametrize("model,mode", PRESETS)
def test_group_structure(model, mode):
    g = formed(model, mode)
    groups = kernel_groups(g)
    assert [k.name for k in groups] == [f"k{i:04d}_{k.kind}" for i, k in enumerate(groups)]  # no entry in CTX
    assert [n for k in groups for n in k.nodes] == g.nodes
    outs = set(g.outputs.values())
    for i, k in enumerate(groups):
        defined = {v for n in k.nodes for v in n.outputs}
        assert all(v not in defined for v in k.inputs) and len(set(k.inputs)) == len(k.inputs)
        assert {v for n in k.nodes for v in n.inputs} - defined == set(k.inputs)
        for n in k.nodes:
            for v in n.outputs:
                used_outside = v in outs or any(u not in k.nodes for u in g.users(v))
                assert (v in k.outputs) == used_outside, (k.name, v.name)
        if k.kind == "pointwise":
            shape = k.nodes[0].outputs[0].type.shape
            assert all(is_elementwise(n) and same_shape(n.outputs[0].type.shape, shape) for n in k.nodes)
            nxt = groups[i + 1].nodes[0] if i + 1 < len(groups) else None
            assert not (nxt is not None and is_elementwise(nxt) and same_shape(nxt.outputs[0].type.shape, shape))
        elif k.kind == "rowwise":
            assert is_row_op(k.nodes[0]) and all(is_elementwise(n) for n in k.nodes[1:])
        elif k.kind == "attn_res_row":  # [elementwise / reshape prologue,] merge, norm of the merge, epilogue
            ops = [n.op for n in k.nodes]
            at = ops.index("attn_res_merge")
            assert ops.count("attn_res_merge") == 1 and k.nodes[at + 1].inputs[0] is k.nodes[at].outputs[0]
            assert is_row_op(k.nodes[at + 1]) and all(is_elementwise(n) for n in k.nodes[at + 2:])
            assert all(is_elementwise(n) or n.op == "reshape" for n in k.nodes[:at])
        else:
            assert len(k.nodes) == 1 and k.kind == k.nodes[0].op
            assert (k.backend == "view") == (k.kind in VIEW_OPS)
            assert (k.backend == "triton") == (k.kind in MODEL_OPS)


def test_deterministic_and_computation_unchanged():
    before = modeled("k3-tiny", "decode")
    after = formed("k3-tiny", "decode")
    again, _ = run_pipeline(modeled("k3-tiny", "decode"), FORM)
    assert stamps(again) == stamps(after)
    binds = {"B": 2, "L": 3}
    ins, params = random_inputs(before, binds, seed=1)
    want = interpret(before, ins, params, bindings=binds)
    got = interpret(after, ins, params, bindings=binds)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
