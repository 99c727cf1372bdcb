"""The k3:: custom ops pass torch.library.opcheck: the fake (meta) kernel agrees with the real one in shape, dtype
and strides, also for non-contiguous inputs, so torch.export and torch.compile trace them faithfully."""

from __future__ import annotations

import pytest
import torch

import models.ops  # noqa: F401  (registers the k3:: ops)

TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` with the same values laid out transposed in memory (last two dims)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _kda(T):
    g = torch.Generator().manual_seed(T)
    B, H, K = 2, 3, 8
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    return (_noncontiguous(q), k, _noncontiguous(v), gate, beta, torch.randn(B, H, K, K, generator=g))


CASES = {
    "kda_recurrence_step": (torch.ops.k3.kda_recurrence.default, lambda: _kda(1)),
    "kda_recurrence_chunked": (torch.ops.k3.kda_recurrence.default, lambda: _kda(40)),
    "dsa_topk": (torch.ops.k3.dsa_topk.default,
                 lambda: (torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4), _noncontiguous(torch.randn(2, 9, 8)), 4)),
    "moe_route": (torch.ops.k3.moe_route.default,
                  lambda: (_noncontiguous(torch.randn(6, 16)), torch.randn(16), 4, 2.5, True)),
    "moe_experts": (torch.ops.k3.moe_experts.default,
                    lambda: (torch.randn(6, 8), torch.rand(6, 2), torch.randint(0, 4, (6, 2)), torch.randn(4, 5, 8),
                             torch.randn(4, 5, 8), torch.randn(4, 8, 5), "silu", 1.0, 1.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck(case):
    op, make = CASES[case]
    torch.library.opcheck(op, make(), test_utils=TESTS)
