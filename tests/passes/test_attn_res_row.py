"""form_kernels' "attn_res_row" groups (residual adds -> AttnRes merge -> RMSNorm in one launch) on k3.1-pro-tiny.

Structure: every attn_res_merge of decode and prefill is inside an attn_res_row launch, with its norm; a sublayer
whose partial is a residual add makes one launch where it made three (pointwise, merge, rowwise), one whose merge
reads a projection directly makes one where it made two; on a TVM target (which has no such kernel) the launches
stay as before, and the arena gives a reshape inside a fused kernel a buffer of its own.
Before / after: each fused group's Triton kernel (interpreted, f32) gives the outputs of the three unfused
kernels it replaces, run in order on the same inputs, to 1e-6 relative.
"""

from __future__ import annotations

import functools
import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from k3c.codegen.triton import emit  # noqa: E402
from k3c.context import CompileContext  # noqa: E402
from k3c.frontend import import_model  # noqa: E402
from k3c.ir.kernels import KernelSpan, kernel_groups  # noqa: E402
from k3c.ir.types import torch_dtype  # noqa: E402
from k3c.passes.form_kernels import assign_backends, group_name, propose_groups  # noqa: E402
from k3c.passes.pipeline import run_pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreted Triton on CPU")
BINDS = {"decode": {"B": 3, "T": 1, "L": 4}, "prefill": {"B": 2, "T": 3, "L": 0}}


@functools.lru_cache(maxsize=None)
def formed(mode: str, target: str = "h200"):
    ctx = CompileContext(target=target, dtype="f32").resolve().for_entry(mode)
    g, _ = run_pipeline(import_model("k3.1-pro-tiny", mode), ["cleanup", "model", "kernels"], ctx=ctx)
    return g, ctx


def unfused(graph, ctx):
    """The launches of `graph` as form_kernels made them before attn_res_row (the plain proposal)."""
    spans, at = [], 0
    for i, (backend, kind, nodes) in enumerate(assign_backends(propose_groups(graph), ctx.backends)):
        spans.append(KernelSpan(group_name(i, kind, "old"), backend, kind, at, len(nodes)))
        at += len(nodes)
    kept, graph.kernels = graph.kernels, spans
    try:
        return {tuple(n.outputs[0].name for n in k.nodes): k for k in kernel_groups(graph)}
    finally:
        graph.kernels = kept


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_every_merge_is_a_row_launch(mode):
    g, ctx = formed(mode)
    groups = kernel_groups(g)
    merges = sum(n.op == "attn_res_merge" for n in g.nodes)
    rows = [k for k in groups if k.kind == "attn_res_row"]
    assert merges == 20 and len(rows) == merges and not [k for k in groups if k.kind == "attn_res_merge"]
    old = unfused(g, ctx)
    saved = 0
    for k in rows:
        ops = [n.op for n in k.nodes]
        assert ops[-1] == "rms_norm" and ops.count("attn_res_merge") == 1
        before = {name for names, o in old.items() for name in names
                  if any(n.outputs[0].name in names for n in k.nodes)}
        replaced = [o for names, o in old.items() if set(names) <= before]
        assert sum(len(o.nodes) for o in replaced) == len(k.nodes)
        want = 3 + ops.count("reshape") if "add" in ops else 2
        assert len(replaced) == want, ops
        saved += want - 1
    assert len(old) - len(groups) == saved
    if mode == "decode":   # residual adds fused in 16 of the 20 sublayers (the others read a projection)
        assert sum("add" in [n.op for n in k.nodes] for k in rows) == 16


def test_tvm_keeps_the_three_launches():
    g, _ = formed("decode", "cpu-x86-64")
    kinds = [k.kind for k in kernel_groups(g)]
    assert "attn_res_row" not in kinds and kinds.count("attn_res_merge") == 20


def test_reshape_inside_a_row_launch_has_a_buffer():
    g, ctx = formed("decode")
    g, _ = run_pipeline(g.copy(), ["memory"], ctx=ctx)
    fused = next(k for k in kernel_groups(g) if k.kind == "attn_res_row" and "reshape" in [n.op for n in k.nodes])
    (view,) = [n for n in fused.nodes if n.op == "reshape"]
    assert view.outputs[0] in fused.outputs and view.inputs[0] not in fused.outputs
    assert view.outputs[0].name in g.memory_plan.offsets and view.inputs[0].name not in g.memory_plan.offsets


def _load(src, path):
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_fused_kernel_equals_the_three_it_replaces(mode, tmp_path):
    g, ctx = formed(mode)
    binds = BINDS[mode]
    old = unfused(g, ctx)
    gen = torch.Generator().manual_seed(0)
    rows = [k for k in kernel_groups(g) if k.kind == "attn_res_row"]
    checked = 0
    picked = [r for r in rows if "reshape" in [n.op for n in r.nodes]][:1] + rows[:2]   # with a reshape, first two
    for k in picked:
        names = {n.outputs[0].name for n in k.nodes}
        parts = [o for key, o in old.items() if set(key) <= names]
        env = {}
        for v in k.inputs:
            t = torch.randn(v.type.concrete_shape(binds), generator=gen, dtype=torch_dtype(v.type.dtype))
            env[v] = t.abs() if v.name.endswith("inter.1") else t
        got = [torch.empty(v.type.concrete_shape(binds), dtype=torch_dtype(v.type.dtype)) for v in k.outputs]
        _load(emit(k), tmp_path / f"{k.name}.py").launch([env[v] for v in k.inputs], got, binds)
        for p in parts:                                 # the old launches in order, each on its own inputs
            if p.backend == "view":
                (n,) = p.nodes
                env[n.outputs[0]] = env[n.inputs[0]].reshape(n.outputs[0].type.concrete_shape(binds))
                continue
            outs = [torch.empty(v.type.concrete_shape(binds), dtype=torch_dtype(v.type.dtype)) for v in p.outputs]
            _load(emit(p), tmp_path / f"{p.name}.py").launch([env[v].contiguous() for v in p.inputs], outs, binds)
            env.update(zip(p.outputs, outs))
        for v, t in zip(k.outputs, got):
            want = env[v]
            err = ((t - want).abs().max() / want.abs().max()).item()
            assert err <= 1e-6, (k.name, v.name, err)
        checked += 1
    assert checked == len(picked) == (3 if mode == "decode" else 2)
