"""The op registry: every IR op declares its schema, type inference, torch reference and cost in one place.

An op is registered with the `op` decorator on its inference function:

    @op("relu", inputs=["x"], kind="elementwise", ref=lambda a, x: [torch.relu(x)], flops=per_elem(1))
    def _(attrs, x): return [x]

- `inputs`: input names in order; a trailing `?` marks an optional input (only trailing inputs may be optional:
  node input lists never hold None), a leading `*` a variadic tail (`cat(*xs)`).
- `attrs`: name -> `Attr(kind, default)`; kinds: int, float, str, bool, dim (int or symbolic dim string),
  dims (list of dims), ints, floats, dtype, json (any JSON data). `REQUIRED` marks attrs without a default.
  Attrs are completed with defaults when a node is built, so equal nodes have equal attr dicts.
- `infer(attrs, *in_types) -> list[TensorType]`: symbolic shape and dtype inference; raises `IRError`.
- `ref(attrs, *tensors) -> list[Tensor]`: the torch reference; dim attrs arrive as concrete ints.
- cost: `flops(attrs, in_types, out_types) -> Dim`; bytes default to read + written (sum of input and output
  sizes), `bytes=` overrides (views: zero).
- `effects=True`: the op writes persistent state (caches) or is not deterministic; DCE keeps it and CSE never
  merges it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from k3c.errors import IRError, UnsupportedError
from k3c.ir.types import DTYPES, Dim, TensorType, dim, dim_str, evaluate, nbytes_expr, numel

REQUIRED = object()
_ATTR_KINDS = {"int", "float", "str", "bool", "dim", "dims", "ints", "floats", "dtype", "json"}


@dataclass(frozen=True)
class Attr:
    """Schema of one attribute: `kind` (see module doc), `default` (`REQUIRED` if none), `choices` for str."""

    kind: str
    default: Any = REQUIRED
    choices: tuple | None = None


@dataclass
class OpDef:
    """A registered op. Use `infer`, `ref`, `cost`; see the module docstring for the fields."""

    name: str
    inputs: tuple[str, ...]
    attrs: dict[str, Attr]
    infer_fn: Callable
    ref_fn: Callable
    flops_fn: Callable
    bytes_fn: Callable | None
    kind: str
    effects: bool
    doc: str = ""
    n_required: int = field(init=False)
    variadic: bool = field(init=False)

    def __post_init__(self):
        self._memo: dict = {}
        self.variadic = bool(self.inputs) and self.inputs[-1].startswith("*")
        self.n_required = sum(1 for n in self.inputs if not n.endswith("?") and not n.startswith("*"))

    # ---- attrs ----------------------------------------------------------------------------------------------
    def normalize_attrs(self, attrs: dict) -> dict:
        """Check `attrs` against the schema and fill defaults; raises `IRError` naming the op and attr."""
        out = {}
        for k in attrs:
            if k not in self.attrs:
                raise IRError(f"{self.name}: unknown attr {k!r} (known: {', '.join(self.attrs) or 'none'})")
        for k, spec in self.attrs.items():
            if k in attrs:
                out[k] = _check_attr(self.name, k, spec, attrs[k])
            elif spec.default is REQUIRED:
                raise IRError(f"{self.name}: missing required attr {k!r}")
            else:
                out[k] = spec.default
        return out

    def concrete_attrs(self, attrs: dict, bindings: dict[str, int]) -> dict:
        """`attrs` with every dim / dims attr evaluated to ints under `bindings` (for `ref`)."""
        out = dict(attrs)
        for k, spec in self.attrs.items():
            v = out.get(k)
            if v is None:
                continue
            if spec.kind == "dim":
                out[k] = evaluate(dim(v), bindings)
            elif spec.kind == "dims":
                out[k] = [evaluate(dim(x), bindings) for x in v]
        return out

    # ---- inference, reference, cost ---------------------------------------------------------------------------
    def check_arity(self, n: int) -> None:
        hi = None if self.variadic else len(self.inputs)
        if n < self.n_required or (hi is not None and n > hi):
            want = f"{self.n_required}+" if hi is None else (
                str(hi) if hi == self.n_required else f"{self.n_required}..{hi}")
            raise IRError(f"{self.name} takes {want} inputs ({', '.join(self.inputs)}), got {n}")

    def infer(self, attrs: dict, in_types: list[TensorType]) -> list[TensorType]:
        """Output types for `in_types` (symbolic dims allowed); raises `IRError` on a type or arity error.

        Inference is a pure function of (attrs, input types); results are memoised per op, because a model's
        layers repeat the same typed nodes (93 layers of a few kinds) and the verifier re-infers every node.
        """
        self.check_arity(len(in_types))
        key = (repr(sorted(attrs.items())), tuple(in_types))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tuple(self.infer_fn(attrs, *in_types))
            if len(self._memo) > 65536:  # bound memory: drop the oldest half
                for k in list(self._memo)[:32768]:
                    del self._memo[k]
        return list(hit)

    def ref(self, attrs: dict, *tensors) -> list:
        """Run the torch reference on concrete tensors (attrs with concrete dims); returns a list of tensors."""
        return list(self.ref_fn(attrs, *tensors))

    def cost(self, attrs: dict, in_types: list[TensorType], out_types: list[TensorType]) -> tuple[Dim, Dim]:
        """(FLOP, bytes read + written) as sympy expressions / ints of the dims."""
        flops = dim(self.flops_fn(attrs, in_types, out_types) if self.flops_fn else 0)
        if self.bytes_fn is not None:
            nb = self.bytes_fn(attrs, in_types, out_types)
        else:
            nb = 0
            for t in list(in_types) + list(out_types):
                nb = nb + nbytes_expr(t)
        return flops, dim(nb)


def _check_attr(op: str, name: str, spec: Attr, v: Any) -> Any:
    bad = IRError(f"{op}: attr {name}={v!r} is not of kind {spec.kind}")
    if v is None:
        if spec.default is None:
            return None
        raise bad
    k = spec.kind
    if k == "int" and (not isinstance(v, int) or isinstance(v, bool)):
        raise bad
    if k == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad
        v = float(v)
    if k == "bool" and not isinstance(v, bool):
        raise bad
    if k == "str" and not isinstance(v, str):
        raise bad
    if k == "dtype" and v not in DTYPES:
        raise IRError(f"{op}: attr {name}={v!r} is not a k3c dtype ({', '.join(DTYPES)})")
    if k == "dim":
        v = _dim_attr(v, bad)
    if k == "dims":
        if not isinstance(v, list):
            raise bad
        v = [_dim_attr(x, bad) for x in v]
    if k == "ints" and (not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) for x in v)):
        raise bad
    if k == "floats":
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
            raise bad
        v = [float(x) for x in v]
    if spec.choices is not None and v not in spec.choices:
        raise IRError(f"{op}: attr {name}={v!r} must be one of {', '.join(map(repr, spec.choices))}")
    return v


def _dim_attr(v: Any, bad: Exception) -> int | str:
    """Dim attrs are stored as int or canonical string (so printing / CSE / JSON see one form)."""
    if isinstance(v, bool):
        raise bad
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        d = dim(v)
        return d if isinstance(d, int) else dim_str(d)
    raise bad


_REGISTRY: dict[str, OpDef] = {}


def op(name: str, *, inputs: list[str], attrs: dict[str, Attr] | None = None, ref: Callable,
       flops: Callable | None = None, bytes: Callable | None = None, kind: str = "other",
       effects: bool = False) -> Callable:
    """Decorator registering the decorated inference function as op `name`; raises `IRError` on a duplicate."""
    for a in (attrs or {}).values():
        if a.kind not in _ATTR_KINDS:
            raise IRError(f"op {name}: unknown attr kind {a.kind!r}")

    def deco(infer_fn: Callable) -> Callable:
        if name in _REGISTRY:
            raise IRError(f"op {name!r} is registered twice")
        _REGISTRY[name] = OpDef(name, tuple(inputs), dict(attrs or {}), infer_fn, ref, flops, bytes, kind, effects,
                                (infer_fn.__doc__ or "").strip())
        return infer_fn

    return deco


def get_op(name: str) -> OpDef:
    """The `OpDef` registered as `name`; raises `UnsupportedError` naming the op if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedError(f"op {name!r} is not in the k3c op registry") from None


def all_ops() -> dict[str, OpDef]:
    """A copy of the registry: name -> OpDef."""
    return dict(_REGISTRY)


# ---- helpers shared by the op families ----------------------------------------------------------------------
def per_elem(k: float | int) -> Callable:
    """Cost helper: `k` FLOP per output element (of the first output)."""
    return lambda attrs, ins, outs: numel(outs[0]) * k


def zero_cost(attrs, ins, outs) -> int:
    return 0


def norm_axis(d: int, rank: int, op: str = "") -> int:
    """Normalise an axis (`-1` -> `rank - 1`); raises `IRError` when out of range."""
    if not -max(rank, 1) <= d < max(rank, 1):
        raise IRError(f"{op}: dim {d} out of range for rank {rank}")
    return d % max(rank, 1)


def same_dtype(op: str, *ts: TensorType) -> str:
    """The common dtype of `ts`; raises `IRError` if they differ (k3c requires explicit `cast` nodes)."""
    dts = {t.dtype for t in ts}
    if len(dts) != 1:
        raise IRError(f"{op}: input dtypes differ ({', '.join(str(t) for t in ts)}); insert a cast")
    return ts[0].dtype


def broadcast_shapes(op: str, *shapes: tuple) -> tuple:
    """Numpy broadcasting of symbolic shapes: equal dims, or 1 against anything; symbols are assumed != 1.

    Raises `IRError` for incompatible dims (e.g. `T` against `B`, or 3 against 4).
    """
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        d: Any = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            x = s[j]
            if x == 1:
                continue
            if d == 1:
                d = x
            elif d != x and dim(d - x) != 0:
                raise IRError(f"{op}: shapes {', '.join(_fmt(s) for s in shapes)} do not broadcast")
        out.append(d)
    return tuple(out)


def _fmt(shape: tuple) -> str:
    from k3c.ir.types import dim_str

    return "[" + ",".join(dim_str(d) for d in shape) + "]"


def need_rank(op: str, t: TensorType, rank: int, what: str = "input") -> None:
    if t.rank != rank:
        raise IRError(f"{op}: {what} must have rank {rank}, got {t}")


def need_dtype(op: str, t: TensorType, dtypes, what: str = "input") -> None:
    if t.dtype not in dtypes:
        raise IRError(f"{op}: {what} must be {'/'.join(sorted(dtypes))}, got {t}")


def need_eq(op: str, a: Dim, b: Dim, what: str) -> None:
    """Raise `IRError` unless dims `a` and `b` are equal."""
    if a != b and dim(a - b) != 0:
        raise IRError(f"{op}: {what}: {a} != {b}")
