"""Tensor types of the k3c IR: a shape of (possibly symbolic) dims and a short dtype name.

A `Dim` is a Python `int` or a sympy expression over named symbols (`B` batch, `T` new tokens, `L` cached
tokens, `N` routed tokens, ...). Symbols are positive integers, so `L + T`, `(B*T*H)/H` and friends simplify.
Dims are normalised by `dim()`: a constant sympy expression becomes an `int`, a string is parsed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

import sympy
import torch

from k3c.errors import IRError, UnsupportedError

Dim = Union[int, sympy.Expr]

#: dtype name -> (torch dtype, bytes per element). The IR only uses these short names.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "f32": (torch.float32, 4),
    "bf16": (torch.bfloat16, 2),
    "f16": (torch.float16, 2),
    "f8e4m3": (torch.float8_e4m3fn, 1),
    "i64": (torch.int64, 8),
    "i32": (torch.int32, 4),
    "u8": (torch.uint8, 1),
    "bool": (torch.bool, 1),
}
FLOAT_DTYPES = frozenset({"f32", "bf16", "f16", "f8e4m3"})
INT_DTYPES = frozenset({"i64", "i32", "u8"})
_FROM_TORCH = {td: name for name, (td, _) in DTYPES.items()}

#: Symbols a graph may use unless it declares more (`Graph.symbols`): batch, new tokens, cached tokens,
#: routed token count, max sequence.
DEFAULT_SYMBOLS = frozenset({"B", "T", "L", "N", "S"})


def check_dtype(name: str) -> str:
    """Return `name` if it is a k3c dtype; raises `UnsupportedError` otherwise."""
    if name not in DTYPES:
        raise UnsupportedError(f"unknown dtype {name!r}; k3c dtypes are {', '.join(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a k3c dtype name (`"bf16"` -> `torch.bfloat16`); raises `UnsupportedError`."""
    return DTYPES[check_dtype(name)][0]


def dtype_of(t: torch.dtype) -> str:
    """The k3c dtype name of a torch dtype; raises `UnsupportedError` for dtypes k3c does not use."""
    try:
        return _FROM_TORCH[t]
    except KeyError:
        raise UnsupportedError(f"torch dtype {t} has no k3c equivalent") from None


def itemsize(name: str) -> int:
    """Bytes per element of a k3c dtype."""
    return DTYPES[check_dtype(name)][1]


@lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    """The (cached) positive-integer sympy symbol named `name`."""
    return sympy.Symbol(name, integer=True, positive=True)


_DIM_FUNCS = {"floor": sympy.floor, "ceiling": sympy.ceiling, "Max": sympy.Max, "Min": sympy.Min, "Mod": sympy.Mod}


@lru_cache(maxsize=4096)
def _parse(text: str) -> Dim:
    # Map every identifier to a positive-integer symbol, except the few functions dims may use: sympify alone
    # would read `N`, `S`, `E`, `I`, `Q` as sympy objects.
    names = {n: symbol(n) for n in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text) if n not in _DIM_FUNCS}
    names.update(_DIM_FUNCS)
    try:
        expr = sympy.sympify(text, locals=names)
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise IRError(f"cannot parse dim {text!r}: {e}") from None
    if not isinstance(expr, sympy.Expr):
        raise IRError(f"dim {text!r} is not an expression")
    expr = expr.xreplace({s: symbol(s.name) for s in expr.free_symbols})
    return _norm(expr)


def _norm(expr: sympy.Expr) -> Dim:
    if expr.has(sympy.Float):
        raise IRError(f"dim {expr} has a floating-point constant")
    if expr.is_number:
        if not expr.is_integer:
            raise IRError(f"dim {expr} is not an integer")
        return int(expr)
    return expr


def dim(x: int | str | sympy.Expr) -> Dim:
    """Normalise a dim: `3`, `"L+T"`, `sympy.Symbol("T") + 1` -> `int` or sympy expression.

    Strings are parsed with sympy (`"T//2"` and `"floor(T/2)"` both work); every symbol becomes a positive
    integer symbol. Raises `IRError` for anything that is not an integer-valued expression.
    """
    if isinstance(x, bool):
        raise IRError(f"dim {x!r} is a bool")
    if isinstance(x, int):
        return x
    if isinstance(x, str):
        return _parse(x.strip())
    if isinstance(x, sympy.Basic):
        if x.free_symbols and any(not (s.is_integer and s.is_positive) for s in x.free_symbols):
            x = x.xreplace({s: symbol(s.name) for s in x.free_symbols})
        return _norm(x)
    if hasattr(x, "__index__"):
        return int(x)
    raise IRError(f"cannot make a dim of {x!r} ({type(x).__name__})")


def dim_str(d: Dim) -> str:
    """Text form of a dim: `12288`, `T`, `L + T`. `dim(dim_str(d)) == d`."""
    return str(d) if isinstance(d, int) else _expr_str(d)


@lru_cache(maxsize=65536)
def _expr_str(d: sympy.Expr) -> str:  # sympy's printer is slow, and types print and serialise often (CSE keys, JSON)
    return sympy.sstr(d).replace(" ", "")


def dim_json(d: Dim) -> int | str:
    """JSON form of a dim: an int stays an int, an expression becomes its string."""
    return d if isinstance(d, int) else dim_str(d)


def dims_equal(a: Dim, b: Dim) -> bool:
    """True when two dims are provably equal (structurally, or after `sympy.simplify(a - b) == 0`)."""
    if a == b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    return _dims_equal(a, b)


@lru_cache(maxsize=65536)
def _dims_equal(a: Dim, b: Dim) -> bool:
    # sympy keeps expressions canonical, so an int never equals an expression with free symbols; a polynomial
    # difference that expands to a number decides it; only the rest (floor, Max, ...) needs simplify.
    if isinstance(a, int) != isinstance(b, int):
        other = b if isinstance(a, int) else a
        if other.free_symbols:
            return False
    diff = sympy.expand(sympy.Integer(0) + a - b)
    if diff.is_number:
        return diff == 0
    return sympy.simplify(diff) == 0


def free_symbols(d: Dim) -> set[str]:
    """Names of the symbols a dim uses."""
    return set() if isinstance(d, int) else {s.name for s in d.free_symbols}


def evaluate(d: Dim, bindings: dict[str, int]) -> int:
    """The concrete value of a dim under `bindings` (symbol name -> int); raises `IRError` if a symbol is unbound."""
    if isinstance(d, int):
        return d
    missing = free_symbols(d) - set(bindings)
    if missing:
        raise IRError(f"dim {dim_str(d)} needs values for {', '.join(sorted(missing))}")
    v = d.xreplace({symbol(k): sympy.Integer(v) for k, v in bindings.items()})
    if not v.is_integer:
        raise IRError(f"dim {dim_str(d)} is not an integer under {bindings}")
    return int(v)


@dataclass(frozen=True)
class TensorType:
    """The type of an IR value: `shape` (tuple of `Dim`) and `dtype` (a key of `DTYPES`).

    The constructor normalises dims with `dim()` and checks the dtype (`UnsupportedError` if unknown).
    Printed as `bf16[B,T,12288]`; a scalar (rank 0) prints as `f32[]`.
    """

    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(dim(d) for d in self.shape))
        check_dtype(self.dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.shape, dtype)

    def is_concrete(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def concrete_shape(self, bindings: dict[str, int]) -> tuple[int, ...]:
        """The shape with every symbol replaced by its value in `bindings` (raises `IRError` if unbound)."""
        return tuple(evaluate(d, bindings) for d in self.shape)

    def symbols(self) -> set[str]:
        out: set[str] = set()
        for d in self.shape:
            out |= free_symbols(d)
        return out

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(dim_str(d) for d in self.shape)}]"

    def to_json(self) -> dict:
        return {"shape": [dim_json(d) for d in self.shape], "dtype": self.dtype}

    @staticmethod
    def from_json(obj: dict) -> "TensorType":
        return TensorType(tuple(obj["shape"]), obj["dtype"])


def numel(t: TensorType) -> Dim:
    """Number of elements of `t` as a `Dim` (sympy product of the dims; 1 for a scalar)."""
    out: Dim = 1
    for d in t.shape:
        out = out * d
    return dim(out) if not isinstance(out, int) else out


def nbytes_expr(t: TensorType) -> Dim:
    """Size of `t` in bytes as a `Dim` (numel x itemsize)."""
    n = numel(t)
    return n * itemsize(t.dtype)


def nbytes(t: TensorType, bindings: dict[str, int] | None = None) -> int:
    """Size of `t` in bytes, with symbols evaluated under `bindings` (raises `IRError` if one is unbound)."""
    if t.is_concrete():
        return math.prod(t.shape) * itemsize(t.dtype)
    return _nbytes_bound(t, tuple(sorted((bindings or {}).items())))


@lru_cache(maxsize=65536)
def _nbytes_bound(t: TensorType, bindings: tuple) -> int:  # memory planning sizes every value; layers repeat types
    return evaluate(dim(nbytes_expr(t)), dict(bindings))
