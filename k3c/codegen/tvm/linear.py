"""TVM CPU kernel for "linear" at decode shapes: y[m, n] = Σ_k x[m, k] · w[n, k] (+ b[n]), a GEMV per row.

A linear whose rows are a few tokens (decode: x is [B, 1, K] or [B, K]; the last-token lm_head of prefill) reads
its weight once and does 2 flops per weight element: it is bound by memory bandwidth, where torch's GEMM reads
3-5 GB/s at 4 rows on the 2-core x86 machine of BENCHMARKS.md "CPU" (this kernel: 7-13 GB/s at 4 rows, 10-16 at
one). The schedule streams the weight once from memory:

    parallel over blocks of R consecutive output features n (R = 8 when N allows: 8 weight rows in flight per
    thread, which keeps the hardware prefetchers busy); per row m of x, R × 8 fp32 partial sums over k (8 lanes
    per weight row: LLVM emits AVX2 vector FMAs), then the 8 lanes summed and the bias added.

For m > 0 the block's R weight rows (R · K · 4 bytes: 32 KB at K = 1024) are read again from L1/L2, not memory.
`is_gemv` says which linears take this kernel (rows free of T and L); the others (prefill GEMMs) stay torch
calls, which are compute-bound and faster there. Exact semantics: `F.linear` (k3c/ir/ops/linalg.py), in fp32;
the sum order differs from torch's, so results agree to fp32 rounding (≤ 1e-5 relative at K ≤ 4096).
"""

from __future__ import annotations

import math

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.script import LANES, Func, const_int, dim_expr, load, single_node, store_value
from k3c.ir.types import free_symbols

#: Output features per parallel task (the largest of these that divides N).
ROWS = (8, 4, 2, 1)


def is_gemv(node) -> bool:
    """Whether linear `node` runs as this GEMV: its rows (x's leading dims) do not grow with T or L, and its
    weight has constant dims (float dtypes only; the caller excludes fp8)."""
    x, w = node.inputs[0], node.inputs[1]
    rows = math.prod(x.type.shape[:-1]) if x.type.rank > 1 else 1
    return not (free_symbols(rows) & {"T", "L"}) and all(const_int(d) is not None for d in w.type.shape)


@generator("linear")
def gen_linear(name: str, group, device: str) -> str:
    node = single_node(group)
    x, w = node.inputs[:2]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    y = node.outputs[0]
    N, K = (const_int(d) for d in w.type.shape)
    M = dim_expr(math.prod(x.type.shape[:-1]) if x.type.rank > 1 else 1)
    R = next(r for r in ROWS if N % r == 0)
    names = ["x", "w"] + (["b"] if bias is not None else []) + ["y"]
    dt = {n: v.type.dtype for n, v in zip(names, list(node.inputs) + [y])}
    f = Func(name, group.inputs, group.outputs, device, f"linear GEMV ({M} rows x {K} -> {N}, {R} features per task"
             f"{', bias' if bias is not None else ''})", names=names)
    with f.parallel("nb", N // R):
        with f.block(f"for m in T.serial({M}):"):
            if K % LANES:  # no vector lanes: one serial sum per output feature
                with f.block(f"for r in T.serial({R}):"):
                    f.emit(f"n = nb * {R} + r")
                    f.dot("acc", K, lambda k: f"{load('w', f'n * {K} + {k}', dt['w'])} * "
                                              f"{load('x', f'm * {K} + {k}', dt['x'])}")
                    _store(f, "acc", bias, dt, N)
            else:
                acc = f.local(R * LANES, name="acc")
                with f.block(f"for l in T.serial({R * LANES}):"):
                    f.emit(f"{acc}[l] = T.float32(0.0)")
                with f.block(f"for k0 in T.serial({K // LANES}):"), f.block(f"for r in T.serial({R}):"), \
                        f.block(f"for l in T.serial({LANES}):"):
                    k = f"k0 * {LANES} + l"
                    wk, xk = load("w", f"(nb * {R} + r) * {K} + {k}", dt["w"]), load("x", f"m * {K} + {k}", dt["x"])
                    f.emit(f"{acc}[r * {LANES} + l] = {acc}[r * {LANES} + l] + {wk} * {xk}")
                with f.block(f"for r in T.serial({R}):"):
                    f.emit(f"n = nb * {R} + r")
                    f.emit(f"s = {' + '.join(f'{acc}[r * {LANES} + {i}]' for i in range(LANES))}")
                    _store(f, "s", bias, dt, N)
    return f.text()


def _store(f: Func, value: str, bias, dt: dict, N: int) -> None:
    """y[m, n] = value (+ b[n]), converted to y's dtype."""
    if bias is not None:
        value = f"{value} + {load('b', 'n', dt['b'])}"
    f.emit(f"y[m * {N} + n] = {store_value(value, dt['y'])}")
