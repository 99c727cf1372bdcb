"""Evaluate the symbolic dims an artifact stores (`"L+T"`, `"B*T"`, `12288`) at run-time sizes, without sympy.

Only integers, the names in `sizes`, + - * and // (and floor/ceiling/Max/Min as sympy prints them) are accepted;
anything else is an ArtifactError (the artifact is corrupt or from a newer compiler).
"""

from __future__ import annotations

import ast
import operator
from functools import lru_cache

from k3c.errors import ArtifactError

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.truediv, ast.Mod: operator.mod}
_FUNCS = {"floor": lambda x: int(x // 1), "ceiling": lambda x: int(-(-x // 1)), "Max": max, "Min": min}


@lru_cache(maxsize=4096)
def _parse(text: str) -> ast.AST:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ArtifactError(f"cannot read dim {text!r}") from None


def _eval(node: ast.AST, sizes: dict[str, int]):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in sizes:
            raise ArtifactError(f"dim symbol {node.id!r} has no value (known: {', '.join(sorted(sizes))})")
        return sizes[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_eval(node.left, sizes), _eval(node.right, sizes))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, sizes)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        return _FUNCS[node.func.id](*(_eval(a, sizes) for a in node.args))
    raise ArtifactError(f"unsupported expression in a dim: {ast.dump(node)[:80]}")


def evaluate(d: int | str | None, sizes: dict[str, int]) -> int | None:
    """The int value of dim `d` under `sizes` (e.g. {"B": 1, "T": 64, "L": 0}); None stays None (an open end)."""
    if d is None or isinstance(d, int):
        return d
    v = _eval(_parse(d), sizes)
    if v != int(v):
        raise ArtifactError(f"dim {d!r} is not an integer at {sizes}")
    return int(v)


def shape(dims: list, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(d, sizes) for d in dims)


def symbols(d: int | str | None) -> frozenset[str]:
    """The size names dim `d` depends on ("L+T" -> {"L", "T"}; an int or None -> none)."""
    if d is None or isinstance(d, int):
        return frozenset()
    return frozenset(n.id for n in ast.walk(_parse(d)) if isinstance(n, ast.Name) and n.id not in _FUNCS)
