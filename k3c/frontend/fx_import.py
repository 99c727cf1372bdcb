"""Translate an exported FX graph (ATen + `k3::` custom ops) into k3c IR nodes.

`FxImporter(graph).run(segment, inputs, params, symbols, layer)` appends the segment's computation to a k3c
`Graph`: placeholders bind to the given input values and parameters, every ATen call becomes one registry op (or
none: metadata asserts, no-op casts and clones disappear), and symbolic sizes (SymInt) become dim expressions over
the k3c symbols B, T, L, N. Output and intermediate types are re-inferred by the registry and checked against the
shapes torch.export recorded, so an importer bug shows up at the node it happens, not later.
An ATen op without a rule raises `UnsupportedError` naming the op and the model line that produced it.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

import sympy
import torch
from torch.fx import Node as FxNode

from k3c.errors import IRError, UnsupportedError
from k3c.ir.graph import Graph, Value
from k3c.ir.types import dim, dims_equal, dtype_of, symbol
from models import ops as _k3_ops  # noqa: F401  (registers torch.ops.k3.*)

aten = torch.ops.aten
_INT64_MAX = 2**63 - 1
_RULES: dict[Any, Callable] = {}


def rule(*targets):
    def deco(fn):
        for t in targets:
            _RULES[t] = fn
        return fn

    return deco


def model_line(fx: FxNode) -> str:
    """`models/layers.py:123 (code)` for the innermost frame of the reference model that made `fx`."""
    trace = fx.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]*models/[^"]+)", line (\d+), in \w+\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{path[path.rfind('models/'):]}:{line} ({code.strip()[:60]})"


class FxImporter:
    """Appends FX segments to one k3c graph.

    A segment is run once per use (a 93-layer model runs each piece dozens of times), so what depends only on an
    FX node is computed once: dim conversions (per symbol binding), each node's module path and model line, and
    the check of its IR type against the exported shape (per binding and IR type).
    """

    def __init__(self, graph: Graph):
        self.g = graph
        self._dim_cache: dict[tuple, Any] = {}
        self._where: dict[FxNode, tuple[str, str]] = {}
        self._checked: set[tuple] = set()

    # ---- symbolic sizes ------------------------------------------------------------------------------------------
    def dim(self, d) -> int | str:
        """A torch size (int or SymInt) as a k3c dim attr (int or canonical string over B, T, L, N)."""
        if isinstance(d, int):
            return d
        if isinstance(d, str):  # already a k3c dim (from sym_size of an IR value)
            return d
        expr = d.node.expr if isinstance(d, torch.SymInt) else d
        if isinstance(expr, (int, sympy.Integer)):
            return int(expr)
        key = (expr, self._subs_key)
        if key not in self._dim_cache:
            out = dim(expr.xreplace(self.subs))
            self._dim_cache[key] = out if isinstance(out, int) else str(out)
        return self._dim_cache[key]

    def shape(self, fx: FxNode) -> list:
        return [self.dim(d) for d in fx.meta["val"].shape]

    # ---- running -------------------------------------------------------------------------------------------------
    def run(self, program, inputs: list[Value], params: Callable[[str], Value], subs: dict, layer: int | None,
            hint: str, source: str = "") -> list[Value]:
        """Append `program` (an ExportedProgram) to the graph.

        inputs: values for the user inputs in order; params(fqn) -> the parameter value of a module parameter;
        subs: {export symbol -> k3c dim}; layer: stamped into node meta; hint: the prefix of value names;
        source: node meta "source" where no model line made the node. Returns the user outputs in order.
        """
        self.subs, self._subs_key = subs, tuple(sorted((str(k), str(v)) for k, v in subs.items()))
        self.layer, self.hint, self.source = layer, hint, source
        sig = program.graph_signature
        to_param = dict(sig.inputs_to_parameters)
        env: dict[FxNode, Any] = {}
        user_inputs = iter(inputs)
        for fx in program.graph.nodes:
            if fx.op == "placeholder":
                if fx.name not in to_param:
                    env[fx] = next(user_inputs)
                elif fx.users:  # a piece may lift parameters of its layer that it does not read
                    env[fx] = params(to_param[fx.name])
            elif fx.op == "call_function":
                fn = _RULES.get(fx.target)
                if fn is None:
                    raise UnsupportedError(f"no k3c lowering for {fx.target} (from {model_line(fx) or fx.name})")
                args = [self._arg(a, env) for a in fx.args]
                kwargs = {k: self._arg(v, env) for k, v in fx.kwargs.items()}
                self.fx = fx
                env[fx] = fn(self, *args, **kwargs)
                self._check(fx, env[fx])
            elif fx.op == "output":
                outs = [self._arg(a, env) for a in fx.args[0]]
                return [o for o in outs if isinstance(o, Value)]
        raise IRError("exported program has no output node")

    def _arg(self, a, env):
        if isinstance(a, FxNode):
            return env[a]
        if isinstance(a, (list, tuple)):
            return [self._arg(x, env) for x in a]
        return a

    def _check(self, fx: FxNode, out) -> None:
        if isinstance(out, Value) and (fx, self._subs_key, out.type) not in self._checked:
            self._checked.add((fx, self._subs_key, out.type))
            want = fx.meta.get("val")
            if isinstance(want, torch.Tensor):
                shape = self.shape(fx)
                if len(shape) != out.type.rank or not all(dims_equal(dim(a), b) for a, b in zip(shape, out.type.shape)) \
                        or dtype_of(want.dtype) != out.type.dtype:
                    raise IRError(f"importer: {fx.target} at {model_line(fx) or fx.name}: IR type {out.type} differs "
                                  f"from the exported {dtype_of(want.dtype)}{shape}")

    # ---- emitting ------------------------------------------------------------------------------------------------
    def emit(self, op: str, inputs: list[Value], **attrs) -> list[Value]:
        where = self._where.get(self.fx)
        if where is None:
            mod = self.fx.meta.get("nn_module_stack")
            path = list(mod.values())[-1][0] if mod else ""
            path = re.sub(r"^(layer\.|L\['self'\]\.)", "", path).replace("L['self'].", "")
            where = self._where[self.fx] = (re.sub(r"[^A-Za-z0-9_.\-]", "_", path), model_line(self.fx))
        path, line = where
        hint = f"{self.hint}.{path}" if path else self.hint
        meta = {"source": line or self.source, "layer": self.layer, "pass": "import"}
        return self.g.add_node(op, inputs, attrs, name_hint=hint, meta=meta)

    def emit1(self, op: str, inputs: list[Value], **attrs) -> Value:
        return self.emit(op, inputs, **attrs)[0]

    def out_dtype(self) -> str:
        return dtype_of(self.fx.meta["val"].dtype)

    def cast(self, v: Value, dt: str) -> Value:
        return v if v.type.dtype == dt else self.emit1("cast", [v], to=dt)


# ---- rules ---------------------------------------------------------------------------------------------------------
def _binary(name: str, reverse_scalar: bool = False):
    def fn(im: FxImporter, a, b, **kw):
        if kw.get("alpha", 1) != 1:
            raise UnsupportedError(f"{name} with alpha at {model_line(im.fx)}")
        if isinstance(a, Value) and isinstance(b, Value):
            dt = a.type.dtype if a.type.dtype == b.type.dtype else dtype_of(
                torch.promote_types(_td(a.type.dtype), _td(b.type.dtype)))
            return im.emit1(name, [im.cast(a, dt), im.cast(b, dt)])
        if isinstance(a, Value):
            return im.emit1(name, [a], scalar=float(b), reverse=reverse_scalar)
        return im.emit1(name, [b], scalar=float(a), reverse=not reverse_scalar)

    return fn


def _td(name: str) -> torch.dtype:
    from k3c.ir.types import torch_dtype

    return torch_dtype(name)


for _n in ("add", "sub", "mul", "div"):
    rule(getattr(aten, _n).Tensor, getattr(aten, _n).Scalar)(_binary(_n))
rule(aten.rsub.Scalar)(_binary("sub", reverse_scalar=True))
for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    rule(getattr(aten, _n).Tensor, getattr(aten, _n).Scalar)(_binary(_n))
rule(aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)(_binary("logical_and"))
rule(aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default)(_binary("logical_or"))
rule(aten.maximum.default)(_binary("maximum"))
rule(aten.minimum.default)(_binary("minimum"))


def _unary(name: str):
    return lambda im, x, **kw: im.emit1(name, [x])


for _n in ("exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh", "silu", "neg", "abs", "relu", "reciprocal"):
    rule(getattr(aten, _n).default)(_unary(_n))
rule(aten.bitwise_not.default, aten.logical_not.default)(_unary("logical_not"))
rule(aten.softplus.default)(lambda im, x, beta=1, threshold=20: im.emit1("softplus", [x], beta=float(beta),
                                                                         threshold=float(threshold)))
rule(aten.pow.Tensor_Scalar)(lambda im, x, e: im.emit1("pow", [x], exponent=float(e)))
rule(aten.clamp.default)(lambda im, x, mn=None, mx=None: im.emit1("clamp", [x], min=mn, max=mx))
rule(aten.where.self)(lambda im, c, x, y: im.emit1("where", [c, x, y]))
rule(aten.masked_fill.Scalar)(lambda im, x, m, v: im.emit1("masked_fill", [x, m], value=float(v)))


@rule(aten._assert_tensor_metadata.default)
def _skip(im, *a, **kw):
    return None


@rule(aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
def _to(im, x, *a, **kw):
    return im.cast(x, im.out_dtype())


@rule(aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default)
def _identity(im, x, *a, **kw):
    return x


def _reduce(name):
    def fn(im, x, dims=None, keepdim=False, **kw):
        dims = [dims] if isinstance(dims, int) else (list(dims) if dims is not None else None)
        out = im.emit1(name, [x], dims=dims, keepdim=bool(keepdim))
        return im.cast(out, im.out_dtype())

    return fn


rule(aten.mean.dim)(_reduce("mean"))
rule(aten.sum.dim_IntList)(_reduce("sum"))
rule(aten.amax.default)(_reduce("amax"))
rule(aten.softmax.int, aten._softmax.default)(
    lambda im, x, d, *a, **kw: im.cast(im.emit1("softmax", [x], dim=d), im.out_dtype()))
rule(aten.linear.default)(lambda im, x, w, b=None: im.emit1("linear", [x, w] + ([b] if b is not None else [])))
rule(aten.einsum.default)(lambda im, eq, xs: im.emit1("einsum", xs, equation=eq))
rule(aten.embedding.default)(lambda im, w, ids, *a: im.emit1("embedding", [w, ids]))
rule(aten.layer_norm.default)(lambda im, x, shape, w=None, b=None, eps=1e-5, *a: im.emit1(
    "layer_norm", [x] + [v for v in (w, b) if v is not None], eps=float(eps)))
rule(aten.conv1d.default)(lambda im, x, w, b=None, stride=(1,), padding=(0,), dilation=(1,), groups=1: im.emit1(
    "conv1d", [x, w] + ([b] if b is not None else []), stride=_one(stride), padding=_one(padding),
    dilation=_one(dilation), groups=groups))


def _one(v):
    return v[0] if isinstance(v, (list, tuple)) else v


@rule(aten.reshape.default, aten.view.default, aten._unsafe_view.default)
def _reshape(im, x, *a):
    return im.emit1("reshape", [x], shape=im.shape(im.fx))


@rule(aten.expand.default)
def _expand(im, x, *a, **kw):
    return im.emit1("expand", [x], shape=im.shape(im.fx))


rule(aten.unsqueeze.default)(lambda im, x, d: im.emit1("unsqueeze", [x], dim=d))
rule(aten.squeeze.dim)(lambda im, x, d: im.emit1("squeeze", [x], dims=[d]))
rule(aten.squeeze.dims)(lambda im, x, d: im.emit1("squeeze", [x], dims=list(d)))
rule(aten.transpose.int)(lambda im, x, a, b: im.emit1("transpose", [x], dim0=a, dim1=b))
rule(aten.permute.default)(lambda im, x, d: im.emit1("permute", [x], dims=list(d)))
rule(aten.cat.default)(lambda im, xs, d=0: im.emit1("cat", [x for x in xs], dim=d))
rule(aten.stack.default)(lambda im, xs, d=0: im.emit1("stack", list(xs), dim=d))
rule(aten.scatter.src)(lambda im, x, d, i, s: im.emit1("scatter", [x, i, s], dim=d))


@rule(aten.slice.Tensor)
def _slice(im, x, d=0, start=None, end=None, step=1):
    size = x.type.shape[d]
    end = None if end is None or (isinstance(end, int) and end >= _INT64_MAX // 2) else im.dim(end)
    if end is not None and dims_equal(dim(end), size):
        end = None
    start = 0 if start is None else im.dim(start)
    if start == 0 and end is None and step == 1:
        return x
    return im.emit1("slice", [x], dim=d, start=start, end=end, step=step)


rule(aten.select.int)(lambda im, x, d, i: im.emit1("select", [x], dim=d, index=im.dim(i)))


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(im, x, sizes, d=0):
    sizes = [im.dim(t.shape[d]) for t in im.fx.meta["val"]]
    return im.emit("split", [x], sizes=sizes, dim=d)


@rule(operator.getitem)
def _getitem(im, xs, i):
    return xs[i]


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(im, *a, **kw):
    nums = [x for x in a if not isinstance(x, (torch.dtype, torch.device))]
    start, end = (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
    return im.emit1("arange", [], start=im.dim(start), end=im.dim(end), dtype=im.out_dtype())


@rule(aten.zeros.default, aten.ones.default, aten.full.default, aten.new_zeros.default, aten.ones_like.default,
      aten.zeros_like.default, aten.full_like.default)
def _fill(im, *a, **kw):
    t = im.fx.target
    if t in (aten.full.default, aten.full_like.default):
        return im.emit1("full", [], shape=im.shape(im.fx), dtype=im.out_dtype(), value=float(a[1]))
    op = "ones" if t in (aten.ones.default, aten.ones_like.default) else "zeros"
    return im.emit1(op, [], shape=im.shape(im.fx), dtype=im.out_dtype())


@rule(aten.sym_size.int)
def _sym_size(im, x, d):
    return x.type.shape[d] if isinstance(x.type.shape[d], int) else str(x.type.shape[d])


def _sym_binary(fn):
    return lambda im, a, b: im.dim(im.fx.meta["val"]) if not (isinstance(a, int) and isinstance(b, int)) else fn(a, b)


for _op in (operator.add, operator.sub, operator.mul, operator.floordiv):
    rule(_op)(_sym_binary(_op))

# ---- k3 custom ops ---------------------------------------------------------------------------------------------------
rule(torch.ops.k3.kda_recurrence.default)(lambda im, q, k, v, g, beta, s: im.emit(
    "kda_recurrence", [q, k, v, g, beta, s], scale=1.0))
rule(torch.ops.k3.dsa_topk.default)(lambda im, q, w, k, topk: im.emit1("dsa_index_topk", [q, w, k], topk=topk))
rule(torch.ops.k3.moe_route.default)(lambda im, logits, bias, top_k, scaling, renorm: im.emit(
    "moe_route", [logits, bias], top_k=top_k, scaling=float(scaling), renormalize=bool(renorm)))
rule(torch.ops.k3.moe_experts.default)(lambda im, z, w, ids, w1, w3, w2, act, beta, lbeta: im.emit1(
    "moe_experts", [z, w, ids, w1, w3, w2], act=act, situ_beta=float(beta), situ_linear_beta=float(lbeta)))


def k3c_symbol(name: str):
    return symbol(name)
