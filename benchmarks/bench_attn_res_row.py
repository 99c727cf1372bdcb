"""The fused AttnRes row launch against the three it replaces, on the GPU (CUDA-graph medians).

One sublayer boundary of K3 at D = 7168, bf16 (Q = 8 pseudo-queries): h = add(a, b) -> attn_res_merge -> rms_norm,
formed by `form_kernels` into one "attn_res_row" launch and, for comparison, into the plain proposal's three
(pointwise add, attn_res_merge, rowwise rms_norm); the generated modules of both are timed with
`triton.testing.do_bench_cudagraph` at decode rows (R = B: 1, 16, 64) and prefill rows (R = T: 640, 2560), and the
fused outputs are compared with the three's. Prints microseconds and writes $OUT/attn_res_row.json (ms). Usage (device
tool, repository root):

    PYTHONPATH=$PWD python3 benchmarks/bench_attn_res_row.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402

from k3c.codegen.triton import emit  # noqa: E402
from k3c.context import CompileContext  # noqa: E402
from k3c.ir import Graph, TensorType  # noqa: E402
from k3c.ir.kernels import KernelSpan, kernel_groups  # noqa: E402
from k3c.ir.types import torch_dtype  # noqa: E402
from k3c.passes.form_kernels import assign_backends, form_kernels, group_name, propose_groups  # noqa: E402

Q, D = 8, 7168


def sublayer() -> Graph:
    g = Graph()
    a, b = (g.add_input(n, TensorType(("B", "T", D), "bf16")) for n in ("a", "b"))
    o = g.add_input("o", TensorType((Q, "B", "T", D), "f32"))
    lse = g.add_input("lse", TensorType((Q, "B", "T"), "f32"))
    q = g.add_input("queries", TensorType((Q, D), "bf16"))
    w = g.add_input("w", TensorType((D,), "bf16"))
    s = g.add("add", a, b)
    h = g.add("attn_res_merge", o, lse, s, q, index=3, eps=1e-5)
    g.set_output("residual", s)
    g.set_output("y", g.add("rms_norm", h, w, eps=1e-5))
    return g


def groupings(g: Graph):
    """(fused groups, unfused groups) of the sublayer."""
    ctx = CompileContext(dtype="bf16").resolve()
    fused = kernel_groups(form_kernels(g, ctx))
    spans, at = [], 0
    for i, (backend, kind, nodes) in enumerate(assign_backends(propose_groups(g), ctx.backends)):
        spans.append(KernelSpan(group_name(i, kind, "old"), backend, kind, at, len(nodes)))
        at += len(nodes)
    g.kernels = spans
    return fused, kernel_groups(g)


def runner(groups, env, sizes, tmp):
    """A closure launching `groups` in order on `env` (value -> tensor; intermediates allocated here)."""
    mods = []
    for k in groups:
        path = Path(tmp) / f"{k.name}.py"
        path.write_text(emit(k))
        spec = importlib.util.spec_from_file_location(f"bench_{k.name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for v in k.outputs:
            env.setdefault(v, torch.empty(v.type.concrete_shape(sizes), dtype=torch_dtype(v.type.dtype),
                                          device="cuda"))
        mods.append((mod, k))

    def run():
        for mod, k in mods:
            mod.launch([env[v] for v in k.inputs], [env[v] for v in k.outputs], sizes)
    return run


def main():
    from triton.testing import do_bench_cudagraph

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for B, T in ((1, 1), (16, 1), (64, 1), (1, 640), (1, 2560)):
            g = sublayer()
            fused, old = groupings(g)
            assert [k.kind for k in fused] == ["attn_res_row"], [k.kind for k in fused]
            sizes = {"B": B, "T": T, "L": 0}
            gen = torch.Generator(device="cuda").manual_seed(0)
            env = {v: torch.randn(v.type.concrete_shape(sizes), generator=gen, device="cuda").to(
                torch_dtype(v.type.dtype)) for v in g.inputs}
            env[g.inputs[3]] = env[g.inputs[3]].abs()      # lse
            ef, eo = dict(env), dict(env)
            run_f, run_o = runner(fused, ef, sizes, tmp), runner(old, eo, sizes, tmp)
            run_f(), run_o()
            err = max(((ef[v].float() - eo[v].float()).abs().max() / eo[v].float().abs().max()).item()
                      for v in g.outputs.values())
            tf, to = do_bench_cudagraph(run_f, rep=50), do_bench_cudagraph(run_o, rep=50)
            res[f"R{B * T}"] = {"fused_ms": tf, "three_ms": to, "max_rel_diff": err}
            print(f"rows {B * T:6d}: fused {tf * 1e3:8.2f} us, three launches {to * 1e3:8.2f} us, "
                  f"max rel diff {err:.2e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "attn_res_row.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
