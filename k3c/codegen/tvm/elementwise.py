"""TVM kernels for "pointwise" groups (fused elementwise chains) and "rowwise" groups (a norm / softmax /
reduction over the last dim, then an elementwise epilogue), generated from the IR nodes' expressions.

Iteration: the group's output shape [..., D] as rows × D. CPU: rows run in parallel, the D columns of a row in a
serial inner loop (LLVM vectorizes it when D is a constant). CUDA: pointwise runs one thread per element; rowwise
one thread block per row, its threads striding over D (coalesced), the row's reduction across the block
(`Func.allreduce`), the epilogue again strided over D. Every IR node becomes one let-binding named after its output
value, computed in fp32 for floats (a `cast` to bf16 rounds through bf16 on the bits), in its own type for
integers, as `bool` for comparisons; only stored values are converted to their IR dtype. An input whose shape
differs from the iteration shape broadcasts (numpy rules): its flat offset uses stride 0 along the broadcast dims.
Semantics: the op registry's torch references in `k3c/ir/ops/elementwise.py` and `reduce.py`; formulas of the row
ops: `k3c/codegen/triton/rowwise.py` (rms_norm, layer_norm, l2norm, softmax, sum / mean / amax / amin).
`maximum` / `minimum` / `clamp` do not propagate NaN (LLVM's maxnum); everything else matches the references.
"""

from __future__ import annotations

from k3c.codegen.tvm import generator
from k3c.codegen.tvm.script import Func, const_int, dim_expr, f32, load, round_bf16, row_threads, store_value
from k3c.errors import UnsupportedError
from k3c.ir.graph import Node, Value
from k3c.ir.types import FLOAT_DTYPES, dims_equal

_ARITH = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_LOGIC = {"logical_and": "T.And({a}, {b})", "logical_or": "T.Or({a}, {b})", "logical_xor": "({a} != {b})"}
_UNARY = {"exp": "T.exp({a})", "log": "T.log({a})", "sqrt": "T.sqrt({a})", "rsqrt": "T.rsqrt({a})",
          "sigmoid": "T.sigmoid({a})", "tanh": "T.tanh({a})", "silu": "({a} * T.sigmoid({a}))",
          "reciprocal": "(T.float32(1.0) / {a})", "neg": "(-{a})", "abs": "T.abs({a})"}
_INT = {"i64": "int64", "i32": "int32", "u8": "uint8"}


def kind_of(dtype: str) -> str:
    """How a value of IR `dtype` is computed: "float" (fp32), "int" (its own type) or "bool"."""
    if dtype == "f8e4m3":
        raise UnsupportedError("TVM elementwise kernels do not handle f8e4m3 values")
    return "float" if dtype in FLOAT_DTYPES else "bool" if dtype == "bool" else "int"


def literal(x: float, dtype: str) -> str:
    k = kind_of(dtype)
    if k == "bool":
        return "T.bool(True)" if x else "T.bool(False)"
    if k == "int":
        if not float(x).is_integer():
            raise UnsupportedError(f"an integer op with the fractional scalar {x}")
        return f"T.{_INT[dtype]}({int(x)})"
    return f32(x)


def convert(expr: str, src: str, dst: str) -> str:
    """Compute value of IR dtype `dst` for `expr` of IR dtype `src` (torch `.to`: float -> int truncates)."""
    ks, kd = kind_of(src), kind_of(dst)
    if kd == "bool":
        return expr if ks == "bool" else f"({expr} != {literal(0, src)})"
    if kd == "float":
        x = expr if ks == "float" else f'T.Cast("float32", {expr})'
        return round_bf16(x) if dst == "bf16" and src != "bf16" else (
            f'T.Cast("float32", T.Cast("float16", {x}))' if dst == "f16" and src != "f16" else x)
    return expr if src == dst else f'T.Cast("{_INT[dst]}", {expr})'


def _pow(a: str, p: float) -> str:
    n = int(p) if float(p).is_integer() else None
    if n is not None and 1 <= abs(n) <= 4:
        prod = " * ".join([a] * abs(n))
        return f"({prod})" if n > 0 else f"(T.float32(1.0) / ({prod}))"
    if n == 0:
        return "T.float32(1.0)"
    if p == 0.5:
        return f"T.sqrt({a})"
    if p == -0.5:
        return f"T.rsqrt({a})"
    return f"T.pow({a}, {f32(p)})"


def node_expr(node: Node, args: list[str]) -> str:
    """TVMScript expression of one elementwise IR node from its operands' compute values. Raises
    `UnsupportedError` naming the node for an op or dtype without a lowering."""
    op, attrs, out = node.op, node.attrs, node.outputs[0]
    dts = [v.type.dtype for v in node.inputs]
    kind = kind_of(dts[0]) if dts else "float"
    if op in _ARITH or op in _COMPARE or op in _LOGIC or op in ("maximum", "minimum"):
        if len(args) == 1:
            s = literal(attrs["scalar"], dts[0])
            args = [s, args[0]] if attrs["reverse"] else [args[0], s]
        a, b = args
        if op in _COMPARE:
            return f"({a} {_COMPARE[op]} {b})"
        if op in _LOGIC:
            return _LOGIC[op].format(a=a, b=b)
        if kind == "bool":
            raise UnsupportedError(f"TVM pointwise: {op} of bool values (%{out.name})")
        if op in ("maximum", "minimum"):
            return f"T.{op[:3]}({a}, {b})"
        if kind == "int" and op == "div":
            return f'T.Cast("{_INT[out.type.dtype]}", T.Cast("float32", {a}) / T.Cast("float32", {b}))'
        return f"({a} {_ARITH[op]} {b})"
    a = args[0] if args else ""
    if op == "cast":
        return convert(a, dts[0], attrs["to"])
    if op == "where":
        return f"T.Select({args[0]}, {args[1]}, {args[2]})"
    if op == "masked_fill":
        return f"T.Select({args[1]}, {literal(attrs['value'], dts[0])}, {a})"
    if op == "logical_not":
        return f"T.Not({a})"
    if op == "relu" and kind != "bool":
        return f"T.max({a}, {literal(0, dts[0])})"
    if op == "clamp" and kind != "bool":
        if attrs["min"] is not None:
            a = f"T.max({a}, {literal(attrs['min'], dts[0])})"
        if attrs["max"] is not None:
            a = f"T.min({a}, {literal(attrs['max'], dts[0])})"
        return a
    if op in ("neg", "abs") and kind != "bool":
        return _UNARY[op].format(a=a)
    if kind == "float":
        if op in _UNARY:
            return _UNARY[op].format(a=a)
        if op == "softplus":  # log(1 + exp(beta x)) / beta, x where beta x > threshold (torch)
            beta, th = attrs["beta"], attrs["threshold"]
            bx = f"({a} * {f32(beta)})"
            return f"T.Select({bx} > {f32(th)}, {a}, T.log1p(T.exp(T.min({bx}, {f32(th)}))) / {f32(beta)})"
        if op == "gelu":
            if attrs["approximate"] == "tanh":  # 0.7978... = sqrt(2/pi), 0.044715: Hendrycks & Gimpel
                return (f"(T.float32(0.5) * {a} * (T.float32(1.0) + T.tanh(T.float32(0.7978845608028654) * "
                        f"({a} + T.float32(0.044715) * {a} * {a} * {a}))))")
            return f"(T.float32(0.5) * {a} * (T.float32(1.0) + T.erf({a} * T.float32(0.7071067811865476))))"
        if op == "pow":
            return _pow(a, attrs["exponent"])
    raise UnsupportedError(f"TVM pointwise: no lowering of {op} on {', '.join(dts)} (%{out.name})")


class Names:
    """Let-binding names of one kernel's IR values, by position (`v0`, `v1`, ...): layers that compute the same
    thing get the same text, so `emit_all` shares their PrimFunc."""

    def __init__(self):
        self._of: dict[Value, str] = {}

    def __call__(self, v: Value) -> str:
        return self._of.setdefault(v, f"v{len(self._of)}")


def split_rows(shape: tuple) -> tuple[str, str]:
    """(rows, D) of an iteration shape [..., D] as script text (a rank-0 shape is one row of one element)."""
    if not shape:
        return "1", "1"
    lead = [dim_expr(d) for d in shape[:-1]]
    return (" * ".join(lead) if lead else "1"), dim_expr(shape[-1])


def row_index(f: Func, shape: tuple, row: str) -> list[str]:
    """Emit the multi-index of row `row` over the leading dims of `shape`; returns its names (one per dim)."""
    names = [f"i{k}" for k in range(len(shape) - 1)]
    rem = row
    for k in reversed(range(len(shape) - 1)):
        if k == 0:
            f.emit(f"{names[k]} = {rem}")
        else:
            d = dim_expr(shape[k])
            f.emit(f"{names[k]} = {rem} % ({d})")
            rem = f"({rem} // ({d}))"
    return names


def offset(v: Value, shape: tuple, idx: list[str], col: str) -> str:
    """Flat offset of `v`'s element at the iteration multi-index (`idx` over the leading dims, `col` the last) of
    `shape`, broadcasting `v` (numpy rules). Raises `UnsupportedError` if `v` does not broadcast to `shape`."""
    vs = tuple(v.type.shape)
    if len(vs) > len(shape):
        raise UnsupportedError(f"%{v.name} : {v.type} does not broadcast to {list(shape)}")
    terms, stride = [], "1"
    pad = len(shape) - len(vs)
    for k in reversed(range(len(vs))):
        d, full = vs[k], shape[k + pad]
        if not dims_equal(d, full):
            if const_int(d) != 1:
                raise UnsupportedError(f"%{v.name} : {v.type} does not broadcast to {list(shape)}")
        elif const_int(d) != 1:
            i = col if k + pad == len(shape) - 1 else idx[k + pad]
            terms.append(i if stride == "1" else f"{i} * {stride}")
        stride = dim_expr(d) if stride == "1" else f"{stride} * ({dim_expr(d)})"
    return " + ".join(reversed(terms)) or "0"


def elementwise_lines(f: Func, nodes: list[Node], env: dict[Value, str], names: Names, shape: tuple,
                      idx: list[str], col: str, stores: list[Value]) -> None:
    """Emit `nodes` as let-bindings (operands from `env`, or loaded from their buffers at the broadcast offset),
    then the stores of `stores` (each must have the iteration `shape`) at the same element."""
    for node in nodes:
        args = []
        for v in node.inputs:
            if v not in env:
                x = f"{f.buf[v]}[{offset(v, shape, idx, col)}]"
                env[v] = load(f.buf[v], offset(v, shape, idx, col), v.type.dtype) \
                    if kind_of(v.type.dtype) == "float" else x
            args.append(env[v])
        y = names(node.outputs[0])
        f.emit(f"{y} = {node_expr(node, args)}  # {node.op}")
        env[node.outputs[0]] = y
    for v in stores:
        if len(v.type.shape) != len(shape) or not all(dims_equal(a, b) for a, b in zip(v.type.shape, shape)):
            raise UnsupportedError(f"TVM elementwise: output %{v.name} : {v.type} is not of the iteration shape")
        at = offset(v, shape, idx, col)
        val = env[v]
        f.emit(f"{f.buf[v]}[{at}] = {store_value(val, v.type.dtype) if kind_of(v.type.dtype) == 'float' else val}")


@generator("pointwise")
def gen_pointwise(name: str, group, device: str) -> str:
    """A fused chain of elementwise nodes over the output shape: rows in parallel, a serial inner loop."""
    if not group.outputs:
        raise UnsupportedError(f"a pointwise group without outputs computes nothing")
    shape = tuple(group.outputs[0].type.shape)
    f = Func(name, group.inputs, group.outputs, device,
             f"{len(group.nodes)} elementwise nodes over {group.outputs[0].type}")
    rows, D = split_rows(shape)
    shape = shape or (1,)
    if device == "cuda":  # one thread per element
        with f.parallel("e", f"{rows} * {D}"):
            f.emit(f"r = e // {D}", f"j = e % {D}")
            idx = row_index(f, shape, "r")
            elementwise_lines(f, group.nodes, {}, Names(), shape, idx, "j", group.outputs)
        return f.text()
    with f.parallel("r", rows):
        idx = row_index(f, shape, "r")
        with f.block(f"for j in T.serial({D}):"):
            elementwise_lines(f, group.nodes, {}, Names(), shape, idx, "j", group.outputs)
    return f.text()


_ROW_OPS = ("rms_norm", "layer_norm", "l2norm", "softmax", "sum", "mean", "amax", "amin")


@generator("rowwise")
def gen_rowwise(name: str, group, device: str) -> str:
    """One row op over the last dim of x [..., D] (fp32 accumulation), then the elementwise epilogue."""
    row, epilogue = group.nodes[0], group.nodes[1:]
    if row.op not in _ROW_OPS:
        raise UnsupportedError(f"{row.op} is not a row op ({', '.join(_ROW_OPS)})")
    x = row.inputs[0]
    xshape = tuple(x.type.shape)
    rows, D = split_rows(xshape)
    f = Func(name, group.inputs, group.outputs, device, f"{row.op} over the last dim of {x.type}"
             + (f" + {len(epilogue)} epilogue nodes" if epilogue else ""))
    names = Names()
    y = row.outputs[0]
    reduce = row.op in ("sum", "mean", "amax", "amin")
    if device == "cuda":
        _rowwise_cuda(f, group, xshape, names)
        return f.text()
    with f.parallel("r", rows):
        idx = row_index(f, xshape, "r")
        xr = f.local(D, name="xr")
        acc = f.local(2, name="acc")
        first = {"softmax": f32(float("-inf")), "amax": f32(float("-inf")), "amin": f32(float("inf"))}
        f.emit(f"acc[0] = {first.get(row.op, f32(0.0))}", f"acc[1] = {f32(0.0)}")
        with f.block(f"for j in T.serial({D}):"):
            f.emit(f"xr[j] = {load(f.buf[x], offset(x, xshape, idx, 'j'), x.type.dtype)}")
            f.emit({"softmax": "acc[0] = T.max(acc[0], xr[j])", "amax": "acc[0] = T.max(acc[0], xr[j])",
                    "amin": "acc[0] = T.min(acc[0], xr[j])", "sum": "acc[0] = acc[0] + xr[j]",
                    "mean": "acc[0] = acc[0] + xr[j]", "layer_norm": "acc[0] = acc[0] + xr[j]"}
                   .get(row.op, "acc[0] = acc[0] + xr[j] * xr[j]"))
        eps = f32(row.attrs["eps"]) if "eps" in row.attrs else None
        dn = f'T.Cast("float32", {D})'
        if row.op == "layer_norm":  # two-pass variance: (x - mean)^2
            f.emit(f"mean = acc[0] / {dn}")
            with f.block(f"for j in T.serial({D}):"):
                f.emit("acc[1] = acc[1] + (xr[j] - mean) * (xr[j] - mean)")
            f.emit(f"inv = T.rsqrt(acc[1] / {dn} + {eps})")
        elif row.op == "softmax":
            with f.block(f"for j in T.serial({D}):"):
                f.emit("xr[j] = T.exp(xr[j] - acc[0])", "acc[1] = acc[1] + xr[j]")
            f.emit(f"inv = {f32(1.0)} / acc[1]")
        elif row.op == "rms_norm":
            f.emit(f"inv = T.rsqrt(acc[0] / {dn} + {eps})")
        elif row.op == "l2norm":
            f.emit(f"inv = T.rsqrt(acc[0] + {eps})")
        if reduce:
            yshape = tuple(y.type.shape) or (1,)
            red = {"mean": f"acc[0] / {dn}"}.get(row.op, "acc[0]")
            env = {y: names(y)}
            f.emit(f"{env[y]} = {red}  # {row.op}")
            keep = len(y.type.shape) == len(xshape)  # keepdim: [..., 1]
            yidx, ycol = (idx, "0") if keep or not idx else (idx[:-1], idx[-1])
            elementwise_lines(f, epilogue, env, names, yshape, yidx, ycol, group.outputs)
            return f.text()
        with f.block(f"for j in T.serial({D}):"):
            row_store(f, group, names, xshape, idx, "xr[j]")  # (softmax: xr holds the exponentials)
    return f.text()


def row_store(f: Func, group, names: Names, xshape: tuple, idx: list[str], x: str) -> None:
    """Emit column `j` of a normalizing row op's output from its input element `x` (inv, mean computed): the
    normalized value, times the weight and plus the bias (inputs 1 and 2, if any), then the epilogue's stores."""
    row, epilogue = group.nodes[0], group.nodes[1:]
    y = row.outputs[0]
    val = f"({x} - mean) * inv" if row.op == "layer_norm" else f"{x} * inv"
    w = [load(f.buf[v], offset(v, xshape, idx, "j"), v.type.dtype) for v in row.inputs[1:]]
    if w:
        val = f"{val} * {w[0]}"
    if len(w) > 1:
        val = f"{val} + {w[1]}"
    env = {y: names(y)}
    f.emit(f"{env[y]} = {val}  # {row.op}")
    elementwise_lines(f, epilogue, env, names, xshape, idx, "j", group.outputs)


_COMBINE = {"softmax": "max", "amax": "max", "amin": "min"}


def _rowwise_cuda(f: Func, group, xshape: tuple, names: Names) -> None:
    """The CUDA schedule of `gen_rowwise`: a block per row (module docstring). Same formulas as the CPU one; the
    partial sums are per thread, combined by `Func.allreduce` (amin as the negated max of −x)."""
    row, epilogue = group.nodes[0], group.nodes[1:]
    x, y = row.inputs[0], row.outputs[0]
    rows, D = split_rows(xshape)
    Dc = const_int(xshape[-1]) if xshape else 1
    nt = row_threads(Dc if Dc is not None else D)
    dn = f'T.Cast("float32", {D})'
    xj = lambda: load(f.buf[x], offset(x, xshape, idx, "j"), x.type.dtype)  # noqa: E731
    ext = Dc if Dc is not None else D

    def reduce_pass(first: str, term: str, op: str) -> str:
        part = f.local(1)
        f.emit(f"{part}[0] = {first}")
        with f.strided("j", ext, nt):
            f.emit(f"xj = {xj()}")
            f.emit(f"{part}[0] = T.max({part}[0], {term})" if op == "max" else f"{part}[0] = {part}[0] + {term}")
        return f.allreduce(f"{part}[0]", op)

    with f.cuda_blocks("r", rows, nt):
        idx = row_index(f, xshape, "r")
        op = _COMBINE.get(row.op, "sum")
        ninf = f32(float("-inf"))
        if op == "max":
            red = reduce_pass(ninf, "xj", "max")
        elif op == "min":
            red = f"(-{reduce_pass(ninf, '(-xj)', 'max')})"
        else:
            red = reduce_pass(f32(0.0), "xj" if row.op in ("sum", "mean", "layer_norm") else "xj * xj", "sum")
        eps = f32(row.attrs["eps"]) if "eps" in row.attrs else None
        f.emit(f"tot = {red}")
        if row.op == "layer_norm":
            f.emit(f"mean = tot / {dn}")
            f.emit(f"inv = T.rsqrt({reduce_pass(f32(0.0), '(xj - mean) * (xj - mean)', 'sum')} / {dn} + {eps})")
        elif row.op == "softmax":
            f.emit(f"inv = {f32(1.0)} / {reduce_pass(f32(0.0), 'T.exp(xj - tot)', 'sum')}")
        elif row.op == "rms_norm":
            f.emit(f"inv = T.rsqrt(tot / {dn} + {eps})")
        elif row.op == "l2norm":
            f.emit(f"inv = T.rsqrt(tot + {eps})")
        if row.op in ("sum", "mean", "amax", "amin"):
            yshape = tuple(y.type.shape) or (1,)
            env = {y: names(y)}
            keep = len(y.type.shape) == len(xshape)  # keepdim: [..., 1]
            yidx, ycol = (idx, "0") if keep or not idx else (idx[:-1], idx[-1])
            with f.block("if tx == 0:"):
                f.emit(f"{env[y]} = {f'tot / {dn}' if row.op == 'mean' else 'tot'}  # {row.op}")
                elementwise_lines(f, epilogue, env, names, yshape, yidx, ycol, group.outputs)
            return
        with f.strided("j", ext, nt):
            f.emit(f"xj = {xj()}")
            row_store(f, group, names, xshape, idx, "T.exp(xj - tot)" if row.op == "softmax" else "xj")
