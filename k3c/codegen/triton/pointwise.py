"""Code generator for "pointwise" groups (fused chains of elementwise IR nodes), and the elementwise machinery
that `rowwise.py` reuses for its epilogues.

The kernel runs over the flattened iteration space of the group's output shape (every output has it), BLOCK
elements per program. Each IR node becomes one statement named after its output value:

    l0_mlp = l0_mlp_gate_proj / 4.0
    l0_mlp_1 = tanh(l0_mlp)

Values are computed in fp32 (float dtypes; a `cast` to bf16/f16 rounds through that dtype), in their own type
(integers, so that ids stay exact) or as int1 (bool). Intermediate values are not rounded to their IR dtype, only
stored outputs are converted to it (fusion computes more precisely than the node-by-node reference). An input
whose shape differs from the iteration shape (numpy broadcasting) is read through per-dim element strides that
`launch` computes from the actual tensor shapes and strides (0 along broadcast dims), from the lane's multi-index.
An input of the iteration shape is read at the flat offset, or, when it is a view whose rows (last dim) lie a
stride apart (a decode GEMM's column slice), at row * stride + column (`ROWS`, decided by `launch` per call), so
views reach the kernel without a copy (`TAKES_VIEWS`). Limits: iteration rank <= 5 and no fp8 values (`UnsupportedError` otherwise).
"""

from __future__ import annotations

import keyword
import math
import re
from dataclasses import dataclass, field

from k3c.codegen.triton import emitter, launch_head, module_header
from k3c.errors import UnsupportedError
from k3c.ir.graph import Node, Value
from k3c.ir.kernels import KernelGroup
from k3c.ir.ops import get_op
from k3c.ir.ops.registry import broadcast_shapes
from k3c.ir.types import FLOAT_DTYPES, dim_str, dims_equal

MAX_RANK = 5
TL_DTYPE = {"f32": "tl.float32", "bf16": "tl.bfloat16", "f16": "tl.float16", "i64": "tl.int64",
            "i32": "tl.int32", "u8": "tl.uint8", "bool": "tl.int1"}
#: Names the generated kernels and launchers use for themselves; IR values never get them.
RESERVED = frozenset({"tl", "triton", "torch", "math", "offs", "mask", "rem", "row", "cols", "numel", "shape",
                      "grid", "inputs", "outputs", "sizes", "D", "BLOCK", "BLOCK_D", "BLOCK_SIZE", "n_rows",
                      "num_warps", "tanh", "softplus", "ROWS", "_row_addr", "_row_view", "inv_rms", "mean", "var", "xc", "row_max", "e", "denom",
                      "NAME", "IR_NODES", "launch", "float", "int", "range", "len", "tuple",
                      "ar_q", "ar_p", "ar_lp", "ar_lo", "ar_m", "ar_o"}
                     | {f"i{j}" for j in range(MAX_RANK)} | {f"size{j}" for j in range(MAX_RANK)})


class Names:
    """Readable, unique, deterministic Python identifiers for the IR values of one generated module.

    `%l0.mlp.gate_proj` -> `l0_mlp_gate_proj`, `%7` -> `v7`; a clash (with another value, a derived name such as
    `<name>_ptr`, or `RESERVED`) appends `_1`, `_2`, ...
    """

    _DERIVED = ("", "_ptr", "_offs", "_rs") + tuple(f"_stride{j}" for j in range(MAX_RANK))

    def __init__(self):
        self._of: dict[Value, str] = {}
        self._taken: set[str] = set(RESERVED)

    def __call__(self, v: Value) -> str:
        name = self._of.get(v)
        if name is None:
            base = re.sub(r"\W", "_", v.name)
            base = base if base and not base[0].isdigit() else f"v{base}"
            name, i = base, 0
            while keyword.iskeyword(name) or any(name + s in self._taken for s in self._DERIVED):
                i += 1
                name = f"{base}_{i}"
            self._taken.update(name + s for s in self._DERIVED)
            self._of[v] = name
        return name


def compute_kind(dtype: str) -> str:
    """How a value of IR `dtype` lives in a kernel: "float" (fp32), "int" (its own type) or "bool" (int1)."""
    if dtype == "f8e4m3":
        raise UnsupportedError("generated pointwise/rowwise kernels do not handle f8e4m3 values")
    if dtype in FLOAT_DTYPES:
        return "float"
    return "bool" if dtype == "bool" else "int"


def literal(x: float, kind: str) -> str:
    """Python source of scalar `x` as a kernel operand of `kind` (non-finite floats as `float("inf")` etc.)."""
    if kind == "bool":
        return repr(bool(x))
    if kind == "int" and float(x).is_integer():
        return repr(int(x))
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    return repr(float(x))


def round_to(expr: str, dtype: str) -> str:
    """An fp32 expression rounded through float `dtype` (identity for f32), as a `cast` to that dtype must."""
    return expr if dtype == "f32" else f"{expr}.to({TL_DTYPE[dtype]}).to(tl.float32)"


def convert(expr: str, src: str, dst: str) -> str:
    """The compute value of IR dtype `dst` for compute value `expr` of IR dtype `src` (torch `.to` semantics:
    float -> int truncates toward zero, anything -> bool is `!= 0`)."""
    ks, kd = compute_kind(src), compute_kind(dst)
    if kd == "bool":
        return expr if ks == "bool" else f"({expr} != 0)"
    if kd == "float":
        if ks == "float" and (src == dst or dst == "f32"):
            return expr
        return round_to(f"{expr}.to(tl.float32)" if ks != "float" else expr, dst)
    return expr if src == dst else f"{expr}.to({TL_DTYPE[dst]})"


_ARITH = {"add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "div": "{a} / {b}"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_LOGIC = {"logical_and": "&", "logical_or": "|", "logical_xor": "^"}
_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"  # NaN in -> NaN out, as torch.maximum / clamp
_FLOAT_UNARY = {
    "exp": "tl.exp({a})", "log": "tl.log({a})", "sqrt": "tl.sqrt({a})", "rsqrt": "tl.rsqrt({a})",
    "sigmoid": "tl.sigmoid({a})", "tanh": "tanh({a})", "silu": "{a} * tl.sigmoid({a})",
    "reciprocal": "1.0 / {a}",
}
_GELU = {"none": "0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476))  # erf form; 0.7071... = 1/sqrt(2)",
         "tanh": "0.5 * {a} * (1.0 + tanh(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})))"
                 "  # tanh form; 0.7978... = sqrt(2/pi), 0.044715 from Hendrycks & Gimpel"}


def _binary(node: Node, args: list[str], kinds: list[str]) -> str:
    op, kind = node.op, kinds[0]
    operands = [(x, True) for x in args]  # (source, is a tensor)
    frac = False  # torch: an int tensor op a fractional scalar computes in f32, then `.to(int)`
    if len(args) == 1:
        s = node.attrs["scalar"]
        operands.append((literal(s, kind), False))
        frac = kind == "int" and not float(s).is_integer()
        if node.attrs["reverse"]:
            operands.reverse()
    if op in _COMPARE or op in _LOGIC:
        (a, _), (b, _) = operands
        return f"{a} {_COMPARE.get(op) or _LOGIC[op]} {b}"
    if kind == "bool":
        raise UnsupportedError(f"pointwise: {op} of bool values is not supported (%{node.outputs[0].name})")
    if kind == "int" and (op == "div" or frac):
        (a, ta), (b, tb) = [(f"{x}.to(tl.float32)" if t else x, t) for x, t in operands]
        inner = _ARITH[op].format(a=a, b=b) if op in _ARITH else f"tl.{op}({a}, {b})"
        return f"({inner}).to({TL_DTYPE[node.outputs[0].type.dtype]})"
    (a, _), (b, _) = operands
    if op in _ARITH:
        return _ARITH[op].format(a=a, b=b)
    nan = f", {_NAN_ALL}" if kind == "float" else ""
    return f"tl.{op}({a}, {b}{nan})"  # maximum / minimum


def _pow(a: str, p: float) -> str:
    n = int(p) if float(p).is_integer() else None
    if n is not None and 1 <= abs(n) <= 4:
        prod = " * ".join([a] * abs(n))
        return prod if n > 0 else f"1.0 / ({prod})"
    if n == 0:
        return f"tl.zeros_like({a}) + 1.0"  # torch.pow(x, 0) is 1 everywhere, NaN included
    if p == 0.5:
        return f"tl.sqrt({a})"
    if p == -0.5:
        return f"tl.rsqrt({a})"
    if n is not None:  # |x|^n with the sign of x for odd n
        mag = f"tl.exp({float(n)!r} * tl.log(tl.abs({a})))"
        return f"tl.where({a} < 0, -{mag}, {mag})" if n % 2 else mag
    return f"tl.exp({float(p)!r} * tl.log({a}))"  # NaN for x < 0, as torch


def node_expr(node: Node, args: list[str], helpers: set[str]) -> str:
    """The Triton expression computing `node` (one elementwise IR node) from its operands' compute values.

    `helpers` collects the module-level helper functions the expression calls ("tanh", "softplus").
    Raises `UnsupportedError` naming the node for ops or dtypes without a lowering.
    """
    op, attrs = node.op, node.attrs
    kinds = [compute_kind(v.type.dtype) for v in node.inputs]
    out = node.outputs[0]
    if op in _ARITH or op in _COMPARE or op in _LOGIC or op in ("maximum", "minimum"):
        return _binary(node, args, kinds)
    a = args[0] if args else ""
    if op == "cast":
        return convert(a, node.inputs[0].type.dtype, attrs["to"])
    if op == "where":
        return f"tl.where({args[0]}, {args[1]}, {args[2]})"
    if op == "masked_fill":
        return f"tl.where({args[1]}, {literal(attrs['value'], kinds[0])}, {a})"
    if op == "copy":
        return a
    if op == "logical_not":
        return f"~{a}"
    if op in ("neg", "abs", "relu") and kinds[0] != "bool":
        zero = "0.0" if kinds[0] == "float" else "0"
        return {"neg": f"-{a}", "abs": f"tl.abs({a})", "relu": f"tl.where({a} < 0, {zero}, {a})"}[op]
    if op == "clamp" and kinds[0] != "bool":
        lo, hi = attrs["min"], attrs["max"]
        if kinds[0] == "int" and any(v is not None and not float(v).is_integer() for v in (lo, hi)):
            raise UnsupportedError(f"pointwise: clamp of an integer tensor by a fraction (%{out.name})")
        nan = f", {_NAN_ALL}" if kinds[0] == "float" else ""
        if lo is not None:
            a = f"tl.maximum({a}, {literal(lo, kinds[0])}{nan})"
        if hi is not None:
            a = f"tl.minimum({a}, {literal(hi, kinds[0])}{nan})"
        return a
    if kinds and kinds[0] == "float":
        if op in _FLOAT_UNARY:
            if op == "tanh":
                helpers.add("tanh")
            return _FLOAT_UNARY[op].format(a=a)
        if op == "softplus":
            helpers.add("softplus")
            return f"softplus({a}, {literal(attrs['beta'], 'float')}, {literal(attrs['threshold'], 'float')})"
        if op == "gelu":
            if attrs["approximate"] == "tanh":
                helpers.add("tanh")
            return _GELU[attrs["approximate"]].format(a=a)
        if op == "pow":
            return _pow(a, attrs["exponent"])
    raise UnsupportedError(f"pointwise: no lowering of {op} on {', '.join(v.type.dtype for v in node.inputs)} "
                           f"(%{out.name})")


HELPERS = {
    "tanh": '''@triton.jit
def tanh(x):
    """tanh in fp32 from tl.exp (triton has no tanh on every backend): an odd Taylor polynomial for |x| < 0.2,
    where 1 - 2 / (exp(2|x|) + 1) would cancel, that formula elsewhere. Relative error < 1e-6."""
    x2 = x * x
    # tanh Taylor coefficients 1, -1/3, 2/15, -17/315, 62/2835; the first omitted term is < 2e-10 at |x| = 0.2
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    big = 1.0 - 2.0 / (tl.exp(2.0 * tl.abs(x)) + 1.0)
    return tl.where(tl.abs(x) < 0.2, small, tl.where(x < 0, -big, big))
''',
    "softplus": '''@triton.jit
def softplus(x, beta, threshold):
    """torch.nn.functional.softplus: log(1 + exp(beta * x)) / beta, or x itself where beta * x > threshold."""
    bx = x * beta
    e = tl.exp(tl.minimum(bx, threshold))
    u = 1.0 + e
    # log1p(e) = log(u) * e / (u - 1) cancels u's rounding error (Goldberg 1991); u == 1 means log1p(e) = e
    log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(bx > threshold, x, log1p_e / beta)
''',
}

BROADCAST_STRIDES = '''def _broadcast_strides(t: torch.Tensor, shape: tuple) -> list[int]:
    """Element strides of `t` (any layout) at every dim of `shape` under numpy broadcasting (0 where `t` has size
    1 or lacks the dim). Raises ValueError if `t` does not broadcast to `shape`."""
    strides = [0] * len(shape)
    if t.dim() > len(shape):
        raise ValueError(f"{NAME}: input of shape {list(t.shape)} does not broadcast to {list(shape)}")
    for j in range(1, t.dim() + 1):
        if t.shape[-j] != 1:
            if t.shape[-j] != shape[-j]:
                raise ValueError(f"{NAME}: input of shape {list(t.shape)} does not broadcast to {list(shape)}")
            strides[-j] = t.stride(-j)
    return strides
'''

ROW_VIEW = '''def _row_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` and the element stride between its rows (runs of its last dim), when its last dim is unit-stride and
    its other dims collapse into rows one stride apart (e.g. a column slice of a wider [B, N] buffer); otherwise
    a contiguous copy of `t` and its row length."""
    n = t.shape[-1] if t.dim() else 1
    if t.is_contiguous():
        return t, n
    lead = [d for d in range(t.dim() - 1) if t.shape[d] != 1]
    if (n == 1 or t.stride(-1) == 1) and all(t.stride(a) == t.stride(b) * t.shape[b] for a, b in zip(lead, lead[1:])):
        return t, (t.stride(lead[-1]) if lead else n)
    return t.contiguous(), n
'''

ROW_ADDR = '''@triton.jit
def _row_addr(offs, rs, D, ROWS: tl.constexpr):
    """Element offset of flat index `offs` (rows of D elements) in a view whose rows lie `rs` apart (ROWS), else
    `offs` itself."""
    if ROWS:
        return offs // D * rs + offs % D
    else:
        return offs
'''


@dataclass
class Body:
    """Kernel statements for a run of elementwise nodes, and the extra kernel parameters they need.

    `params`: kernel parameter lines (with comments) after the pointers; `launch_args`: the launcher's
    expressions for them, in order (starred lists); `helpers`: helper functions to paste into the module;
    `row_views`: inputs read as row-strided views (their launcher variable `<name>_rs` holds the row stride).
    """

    lines: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    launch_args: list[str] = field(default_factory=list)
    helpers: set[str] = field(default_factory=set)
    row_views: list[str] = field(default_factory=list)


def same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def shape_str(shape: tuple) -> str:
    return "[" + ",".join(dim_str(d) for d in shape) + "]"


def elementwise_body(nodes: list[Node], loads: list[Value], stores: list[Value], shape: tuple, names: Names,
                     env: dict[Value, str], mask: str | None, rows: str | None = None) -> Body:
    """Statements computing `nodes` at the lanes' flat offsets `offs` into iteration shape `shape`.

    `loads`: values read from memory unless already in `env` (value -> variable holding its compute value);
    `stores`: values written at `offs` (each must have `shape`); `mask`: the lane mask variable, or None when
    `offs` is a scalar. Inputs of another shape are read through broadcast strides. Inputs of `shape` are read at
    `offs`, or, with `rows` (an element-offset expression of their row stride `{rs}`), as row-strided views.
    Updates `env`.
    Raises `UnsupportedError` for rank > 5 broadcasting, fp8 values or ops without a lowering.
    """
    body = Body()
    m = f", mask={mask}" if mask else ""
    rank, indexed = len(shape), False
    for v in loads:
        if v in env:
            continue
        n, kind = names(v), compute_kind(v.type.dtype)
        conv = ".to(tl.float32)" if kind == "float" else ""
        if same_shape(v.type.shape, shape) and rows is not None:
            body.params.append(f"{n}_rs,  # elements between the rows of %{v.name}")
            body.launch_args.append(f"{n}_rs")
            body.row_views.append(n)
            body.lines.append(f"{n} = tl.load({n}_ptr + {rows.format(rs=f'{n}_rs')}{m}){conv}")
        elif same_shape(v.type.shape, shape):
            body.lines.append(f"{n} = tl.load({n}_ptr + offs{m}){conv}")
        else:
            if rank > MAX_RANK:
                raise UnsupportedError(f"generated kernels broadcast over at most {MAX_RANK} dims; %{v.name} "
                                       f"broadcasts to {shape_str(shape)}")
            if not indexed:
                indexed = True
                body.lines += _multi_index(rank)
                if rank > 1:
                    body.params.append(", ".join(f"size{j}" for j in range(1, rank))
                                       + f",  # iteration shape {shape_str(shape)}, dims 1..{rank - 1}")
                    body.launch_args.append("*shape[1:]")
            strides = [f"{n}_stride{j}" for j in range(rank)]
            body.params.append(", ".join(strides) + f",  # element strides of %{v.name} "
                               f"{shape_str(v.type.shape)} per iteration dim (0: broadcast)")
            body.launch_args.append(f"*_broadcast_strides({n}, shape)")
            offs = " + ".join(f"i{j} * {s}" for j, s in enumerate(strides))
            body.lines.append(f"{n} = tl.load({n}_ptr + ({offs}){m}){conv}")
        env[v] = n
    for node in nodes:
        args = [env[v] for v in node.inputs]
        expr = node_expr(node, args, body.helpers)
        out = node.outputs[0]
        env[out] = names(out)
        body.lines.append(f"{env[out]} = {expr}")
    for v in stores:
        if not same_shape(v.type.shape, shape):
            raise UnsupportedError(f"output %{v.name} : {v.type} does not have the iteration shape {shape_str(shape)}")
        val = env[v]
        if compute_kind(v.type.dtype) == "float" and v.type.dtype != "f32":
            val = f"{val}.to({TL_DTYPE[v.type.dtype]})"
        body.lines.append(f"tl.store({names(v)}_ptr + offs, {val}{m})")
    return body


def _multi_index(rank: int) -> list[str]:
    """Lines splitting flat offsets `offs` into indices i0..i{rank-1} of the iteration shape (sizes size1..)."""
    if rank == 0:
        return []
    if rank == 1:
        return ["i0 = offs"]
    out = ["# the lanes' multi-index in the iteration shape, for the broadcast inputs", "rem = offs"]
    for j in range(rank - 1, 0, -1):
        out.append(f"i{j} = rem % size{j}")
        out.append(f"rem = rem // size{j}" if j > 1 else "i0 = rem // size1")
    return out


def check_elementwise(node: Node, group: KernelGroup) -> None:
    """Raise `UnsupportedError` unless `node` is a single-output registry elementwise op."""
    if get_op(node.op).kind != "elementwise" or len(node.outputs) != 1:
        raise UnsupportedError(f"{group.name}: {node.op} (%{node.outputs[0].name}) is not an elementwise op")


def layout_lines(ins: list[str], body: Body, flat: tuple[str, ...] = ()) -> list[str]:
    """The launcher's lines giving each input the layout its kernel indexes (the module takes views,
    `TAKES_VIEWS`): row-strided views keep their strides (`<name>_rs`), broadcast inputs are read through their
    strides, the inputs read at flat offsets (also `flat`) are made contiguous."""
    strided = {a[len("*_broadcast_strides("):].split(",")[0] for a in body.launch_args if "_broadcast_strides" in a}
    out = []
    for n in ins:
        if n in body.row_views:
            out.append(f"    {n}, {n}_rs = _row_view({n})")
        elif n not in strided or n in flat:
            out.append(f"    {n} = {n}.contiguous()")
    return out


def helper_lines(body: Body) -> list[str]:
    """Source of the helper functions `body` uses, in a fixed order."""
    out = []
    for h in ("tanh", "softplus"):
        if h in body.helpers:
            out += [HELPERS[h], ""]
    return out


BLOCK_COMMENT = "# elements per program: 4 warps x 32 lanes x 8 elements (one 32-byte fp32 vector per lane)"


@emitter("pointwise")
def emit_pointwise(group: KernelGroup) -> str:
    """Source of the kernel module for a "pointwise" group: elementwise nodes whose group outputs all have the
    iteration shape (the broadcast of every node's output shape); inputs may broadcast to it.

    The launcher takes the group inputs (any strides: `TAKES_VIEWS`) and contiguous outputs in order, and raises
    ValueError for wrong counts or shapes that do not broadcast. Inputs of the iteration shape that are
    row-strided views switch the kernel to row addressing (`ROWS`) for that call. Raises `UnsupportedError` for non-elementwise nodes, a group without
    outputs, outputs of another shape, rank > 5 broadcasting, fp8, or an op/dtype without a lowering.
    """
    for node in group.nodes:
        check_elementwise(node, group)
    if not group.outputs:
        raise UnsupportedError(f"{group.name}: a pointwise group without outputs computes nothing")
    shape = tuple(broadcast_shapes(group.name, *[n.outputs[0].type.shape for n in group.nodes]))
    names = Names()
    rows = "_row_addr(offs, {rs}, D, ROWS)" if shape else None
    body = elementwise_body(group.nodes, group.inputs, group.outputs, shape, names, {}, "mask", rows)
    ins, outs = [names(v) for v in group.inputs], [names(v) for v in group.outputs]
    k = f"{group.name}_kernel"
    src = module_header(group, f"{len(group.nodes)} elementwise IR nodes over {shape_str(shape)}",
                        __name__, takes_views=True)
    src += helper_lines(body) + ([ROW_ADDR, ""] if body.row_views else [])
    src += ["@triton.jit", f"def {k}("]
    src += [f"    {n}_ptr,  # %{v.name} : {v.type}" for n, v in zip(ins + outs, group.inputs + group.outputs)]
    src += ["    numel,  # elements in the iteration space"] + [f"    {p}" for p in body.params]
    if body.row_views:
        src += [f"    D,  # the iteration shape's last dim {dim_str(shape[-1])}",
                "    ROWS: tl.constexpr,  # some input is a row-strided view: address rows and columns"]
    src += ["    BLOCK: tl.constexpr,", "):",
            "    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
            "    mask = offs < numel"]
    src += [f"    {line}" for line in body.lines]
    src += ["", "", BLOCK_COMMENT, "BLOCK_SIZE = 1024", ""]
    if any("_broadcast_strides" in a for a in body.launch_args):
        src += ["", BROADCAST_STRIDES]
    if body.row_views:
        src += ["", ROW_VIEW]
    src += [""] + launch_head(group, ins, outs, f"Run {group.name}; every output has the iteration shape "
                              f"{shape_str(shape)}.", f"tuple({outs[0]}.shape)",
                              f"the iteration space {shape_str(shape)}", skip_first_check=True)
    src += layout_lines(ins, body)
    src += [f"    numel = {outs[0]}.numel()", "    if numel == 0:", "        return",
            "    grid = (triton.cdiv(numel, BLOCK_SIZE),)"]
    args = ins + outs + ["numel"] + body.launch_args
    if body.row_views:
        src += ["    D = shape[-1]", f"    rows = {' or '.join(f'{n}_rs != D' for n in body.row_views)}"]
        args += ["D", "ROWS=rows"]
    src += [f"    {k}[grid]({', '.join(args)}, BLOCK=BLOCK_SIZE)", ""]
    return "\n".join(src)
