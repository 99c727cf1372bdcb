"""torch.export of the reference model (k3.1-pro-tiny prefill) with symbolic batch, sequence and past length."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from modeltest_util import rel_err, tiny

CUSTOM_OPS = ("k3.kda_recurrence", "k3.dsa_topk", "k3.moe_route", "k3.moe_experts")


def _cache(model, batch: int, past: int, seed: int):
    tokens = torch.randint(0, model.config.vocab_size, (batch, past), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens)[1]


@pytest.fixture(scope="module")
def exported():
    """Exported once per session (~10 s): traced at batch 2, 5 new tokens, 3 cached tokens."""
    model = tiny("k3.1-pro-tiny")
    batch, seq, past = Dim("batch", min=1, max=64), Dim("seq", min=2, max=4096), Dim("past", min=0, max=4096)
    cache = _cache(model, 2, 3, seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    cache_dims = {}
    for key in cache:
        if key == "pos":
            cache_dims[key] = None
        elif key.endswith(("kv", "index_k")):
            cache_dims[key] = {0: batch, 1: past}
        else:  # KDA recurrent and conv states
            cache_dims[key] = {0: batch}
    assert any(k.endswith("index_k") for k in cache) and any(k.endswith("kda_state") for k in cache)
    ep = torch.export.export(model, (tokens, cache), dynamic_shapes=({0: batch, 1: seq}, cache_dims), strict=False)
    return model, ep


@pytest.mark.parametrize("batch,seq,past", [(3, 7, 4), (1, 20, 0), (2, 2, 30)])
def test_exported_program_equals_eager(exported, batch, seq, past):
    """Different shapes from the traced ones, including an empty cache and a DSA-sparse row count (past + seq > 16)."""
    model, ep = exported
    cache = _cache(model, batch, past, seed=batch + past) if past else model.new_cache(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        want, want_cache = model(tokens, cache)
        got, got_cache = ep.module()(tokens, cache)
    assert got.shape == want.shape == (batch, seq, model.config.vocab_size)
    assert rel_err(got, want) <= 1e-5
    assert set(got_cache) == set(want_cache)
    for key in want_cache:
        assert got_cache[key].shape == want_cache[key].shape, key
        if key != "pos":
            assert rel_err(got_cache[key], want_cache[key]) <= 1e-5, key
    assert int(got_cache["pos"]) == past + seq


def test_graph_has_the_custom_ops_and_plain_aten(exported):
    _, ep = exported
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    for op in CUSTOM_OPS:
        assert any(t.startswith(op) for t in targets), f"{op} missing from the exported graph"
    # 7 KDA layers and 3 DSA layers, 9 MoE layers
    assert sum(t.startswith("k3.kda_recurrence") for t in targets) == 7
    assert sum(t.startswith("k3.dsa_topk") for t in targets) == 3
    assert sum(t.startswith("k3.moe_route") for t in targets) == 9
    # the short conv and the norms stay plain ATen, visible to the compiler
    assert any(t.startswith("aten.conv1d") or t.startswith("aten.convolution") for t in targets)
    assert any(t.startswith("aten.rsqrt") for t in targets)
    assert any(t.startswith("aten.layer_norm") or t.startswith("aten.native_layer_norm") for t in targets)
    # nothing else opaque: every call is ATen, a k3 op, or Python's symbolic-int arithmetic
    namespaces = {t.split(".")[0] for t in targets if not t.startswith("<built-in")}
    assert namespaces <= {"aten", "k3"}, namespaces


def test_exported_shapes_are_symbolic(exported):
    _, ep = exported
    tokens_node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name.startswith("tokens"))
    shape = tokens_node.meta["val"].shape
    assert all(isinstance(d, torch.SymInt) for d in shape), shape
    kv_node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name.endswith("kv"))
    assert isinstance(kv_node.meta["val"].shape[1], torch.SymInt)
