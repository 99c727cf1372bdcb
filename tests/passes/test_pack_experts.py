"""Pass `pack_experts`: MXFP4 routed experts replace the dense ones (u8 packed + E8M0 scale parameters, the
checkpoint's layout stacked), and the graph computes what `models/k3.py` computes with the dequantized experts."""

from __future__ import annotations

import pytest
import torch

from k3c.context import CompileContext
from k3c.errors import IRError
from k3c.frontend import graph_inputs, import_model
from k3c.ir.interp import interpret
from k3c.passes.pack_experts import pack_experts_in_place
from k3c.passes.pipeline import run_pipeline
from models.checkpoint import quantize_experts_
from models.config import K3Config
from models.k3 import K3ForCausalLM
from test_canonicalize import one_torch_thread, rel_err  # noqa: F401


@pytest.fixture(scope="module")
def quantized():
    """kimi-linear-tiny (experts on the hidden width) with its experts rounded to MXFP4, the packed tensors and
    the decode graph."""
    m = K3ForCausalLM(K3Config.from_pretrained("kimi-linear-tiny")).init_random_(0).eval()
    packed = quantize_experts_(m)
    return m, packed, import_model(m, "decode")


def test_params_are_the_packed_layout(quantized):
    m, packed, g0 = quantized
    g = g0.copy()
    assert pack_experts_in_place(g, "mxfp4") == sum(m.config.is_moe(i) for i in range(m.config.num_hidden_layers))
    assert not [k for k in g.params if k.endswith((".experts.w1", ".experts.w2", ".experts.w3"))]
    for k, t in packed.items():
        assert g.params[k].type.dtype == "u8" and tuple(g.params[k].type.shape) == tuple(t.shape), k
    E, I, D = m.config.num_experts, m.config.moe_intermediate_size, m.config.hidden_size
    assert tuple(g.params["model.layers.1.block_sparse_moe.experts.w2.weight_scale"].type.shape) == (E, D, I // 32)
    ex = [n for n in g.nodes if n.op == "moe_experts"]
    assert ex and all(n.attrs["weight_format"] == "mxfp4" and len(n.inputs) == 9 for n in ex)
    assert pack_experts_in_place(g, "mxfp4") == 0           # idempotent: nothing dense left
    assert pack_experts_in_place(g0.copy(), "bf16") == 0


def test_packed_graph_matches_the_model(quantized):
    """Decode after a 3-token prefill: the packed graph's logits equal the eager model's (f32, dequantized)."""
    m, packed, g0 = quantized
    g = g0.copy()
    pack_experts_in_place(g, "mxfp4")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, cache = m(torch.randint(0, m.config.vocab_size, (2, 3), generator=gen))
        tok = torch.randint(0, m.config.vocab_size, (2, 1), generator=gen)
        want, _ = m(tok, cache)
    named = {k: p.detach() for k, p in m.named_parameters()} | packed
    got = interpret(g, graph_inputs(m, tok, cache), {k: named[k] for k in g.params})
    assert rel_err(got["logits"], want) <= 1e-5


def test_the_pass_follows_the_context(quantized):
    """In the pipeline the format comes from CompileContext.experts_dtype; None (not resolved) keeps dense experts.
    The scale bound is CompileContext.mxfp4_scale_max (None: 255, nothing known)."""
    g0 = quantized[2]
    packed, _ = run_pipeline(g0, {"model": ["pack_experts"]}, ctx=CompileContext(experts_dtype="mxfp4"))
    bounded, _ = run_pipeline(g0, {"model": ["pack_experts"]},
                              ctx=CompileContext(experts_dtype="mxfp4", mxfp4_scale_max=121))
    dense, _ = run_pipeline(g0, {"model": ["pack_experts"]}, ctx=CompileContext())
    attr = lambda g, a: {n.attrs[a] for n in g.nodes if n.op == "moe_experts"}  # noqa: E731
    assert attr(packed, "weight_format") == {"mxfp4"} and attr(dense, "weight_format") == {"dense"}
    assert attr(packed, "scale_max") == {255} and attr(bounded, "scale_max") == {121}


def test_one_multiply_decoding_needs_the_scale_bound():
    """The MXFP4 decoder multiplies once by 2^(s − 1) only when every scale byte s is ≤ 128 (2^127 is bf16's largest
    power of two); the configuration follows the bound at every row count, and the context refuses a non-byte."""
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config
    from k3c.errors import ConfigError

    assert torch.tensor(2.0 ** 127, dtype=torch.bfloat16).isfinite() and \
        not torch.tensor(2.0 ** 128, dtype=torch.bfloat16).isfinite()
    for rows in (1, 16 * 32, 64 * 32):
        assert mx_default_config(rows, 32, 128)[5] is False
        assert mx_default_config(rows, 32, 129)[5] is True and mx_default_config(rows, 32)[5] is True
    with pytest.raises(ConfigError, match="mxfp4_scale_max 256"):
        CompileContext(mxfp4_scale_max=256)


def test_errors(quantized):
    g = quantized[2].copy()
    with pytest.raises(IRError, match="experts dtype 'fp8'"):
        pack_experts_in_place(g, "fp8")
