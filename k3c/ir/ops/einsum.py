"""einsum: tensor contraction by an Einstein-summation equation (torch.einsum semantics, explicit `->` form)."""

from __future__ import annotations

import torch

from k3c.errors import IRError
from k3c.ir.ops.registry import Attr, need_eq, op, same_dtype
from k3c.ir.types import TensorType, dim


def _parse(eq: str, n: int) -> tuple[list[str], str]:
    if "->" not in eq or "." in eq:
        raise IRError(f"einsum: equation {eq!r} must be explicit ('ab,bc->ac') without ellipsis")
    lhs, out = eq.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != n:
        raise IRError(f"einsum: equation {eq!r} names {len(terms)} operands, got {n}")
    return terms, out


def _flops(attrs, ins, outs):
    terms, out = _parse(attrs["equation"], len(ins))
    sizes = {}
    for t, ty in zip(terms, ins):
        sizes.update(zip(t, ty.shape))
    total = 2
    for letter in sizes:
        total = total * sizes[letter]
    return total


@op("einsum", inputs=["*xs"], attrs={"equation": Attr("str")}, kind="linalg", flops=_flops,
    ref=lambda a, *xs: [torch.einsum(a["equation"], *xs)])
def _einsum(attrs, *xs):
    """einsum(*xs) {equation}: e.g. 'bthd,bshd->bhts'. One dtype; every letter's size agrees across operands."""
    terms, out = _parse(attrs["equation"], len(xs))
    dt = same_dtype("einsum", *xs)
    sizes: dict[str, object] = {}
    for t, ty in zip(terms, xs):
        if len(t) != ty.rank:
            raise IRError(f"einsum: operand {ty} does not match subscripts {t!r}")
        for letter, d in zip(t, ty.shape):
            if letter in sizes:
                need_eq("einsum", sizes[letter], d, f"size of index {letter!r}")
            else:
                sizes[letter] = d
    missing = [c for c in out if c not in sizes]
    if missing:
        raise IRError(f"einsum: output index {missing[0]!r} appears in no operand")
    return [TensorType(tuple(dim(sizes[c]) for c in out), dt)]
