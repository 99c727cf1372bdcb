"""The runtime's library ops that write into their planned buffer (`k3c.runtime.library.INTO_OPS`) give what the
allocating form gives (`run_op`, to fp32 rounding) in place, and decline what they cannot do."""

import pytest
import torch

from k3c.runtime.library import run_op, run_op_into

CASES = {
    "linear": ({}, lambda: [torch.randn(2, 5, 16), torch.randn(24, 16)]),
    "linear+bias": ({}, lambda: [torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)]),
    "matmul": ({}, lambda: [torch.randn(4, 6, 16), torch.randn(16, 12)]),
    "cat": ({"dim": 1}, lambda: [torch.randn(3, 4), torch.randn(3, 7), torch.randn(3, 1)]),
    # MLA absorption (k3c/passes/mla_forms.py): q_nope into the latent (a strided slice of q), o_lat out of it
    "einsum+q_lat": ({"equation": "bthd,hdr->bthr"}, lambda: [torch.randn(2, 3, 4, 7)[..., :5], torch.randn(4, 5, 6)]),
    "einsum+o": ({"equation": "bthr,hvr->bthv"}, lambda: [torch.randn(2, 3, 4, 6), torch.randn(4, 5, 6)]),
    "einsum+outer": ({"equation": "ij,jk->ki"}, lambda: [torch.randn(3, 4), torch.randn(4, 5)]),
    "embedding": ({}, lambda: [torch.randn(10, 8), torch.randint(0, 10, (2, 3))]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_into_matches_allocating_form(case):
    torch.manual_seed(0)
    attrs, make = CASES[case]
    op = case.split("+")[0]
    ins = make()
    want = run_op(op, attrs, ins)[0]
    arena = torch.full((want.numel() + 8,), float("nan"))  # a planned buffer inside a larger arena
    out = arena[4:4 + want.numel()].view(want.shape)
    assert run_op_into(op, attrs, ins, out)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert out.data_ptr() == arena[4:].data_ptr()  # written in place, not rebound
    assert torch.isnan(arena[:4]).all() and torch.isnan(arena[-4:]).all()  # nothing outside the buffer


def test_into_declines_other_dtypes_and_ops():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert not run_op_into("linear", {}, [x, w], torch.empty(2, 4, dtype=torch.float64))
    assert not run_op_into("softmax", {"dim": -1}, [x], torch.empty(2, 8))
    assert not run_op_into("linear", {}, [x, w], torch.empty(4, 2).t())  # a non-contiguous buffer
    # a letter summed within one operand, three operands: einsum declines and writes nothing
    out = torch.full((2, 4), float("nan"))
    assert not run_op_into("einsum", {"equation": "ij,kl->ik"}, [x, w], out)
    assert not run_op_into("einsum", {"equation": "ij,kj,kl->il"}, [x, w, torch.randn(4, 4)], out)
    assert torch.isnan(out).all()
