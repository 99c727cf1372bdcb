"""The frontend: models/k3.py -> torch.export -> k3c IR, checked against eager execution of the model."""

from __future__ import annotations

import pytest
import torch

from k3c.errors import UnsupportedError
from k3c.frontend import build_meta_model, fx_import, graph_inputs, graph_params, import_model
from k3c.frontend.segments import export_segments
from k3c.ir import serialize
from k3c.ir.interp import interpret
from k3c.ir.printer import print_graph
from k3c.ir.types import free_symbols
from k3c.ir.verify import verify
from models.config import TINY_PRESETS, K3Config
from models.k3 import K3ForCausalLM


@pytest.fixture(scope="module", params=TINY_PRESETS)
def tiny(request):
    cfg = K3Config.from_pretrained(request.param)
    return K3ForCausalLM(cfg).init_random_(3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


@pytest.mark.parametrize("batch", [1, 3])
def test_imported_graph_equals_eager(tiny, batch):
    """Prefill (every position's logits, then the last one's) from an empty cache, a second prefill chunk on a
    cache, and decode steps: IR == eager, fp32."""
    gen = torch.Generator().manual_seed(batch)
    prefill_all, decode = import_model(tiny, "prefill"), import_model(tiny, "decode")
    prefill = import_model(tiny, "prefill", logits="last")
    V = tiny.config.vocab_size
    cache = tiny.new_cache(batch)
    for graph, T in ((prefill_all, 6), (prefill, 5), (decode, 1), (decode, 1)):
        tokens = torch.randint(0, V, (batch, T), generator=gen)
        with torch.no_grad():
            ref, new_cache = tiny(tokens, cache)
        out = interpret(graph, graph_inputs(tiny, tokens, cache), graph_params(tiny, graph))
        if graph is prefill:  # the lm_head runs on the last row only
            assert out["logits"].shape == (batch, 1, V)
            ref = ref[:, -1:]
        assert _rel(out["logits"], ref) <= 1e-5
        for key, value in new_cache.items():
            if key != "pos":
                assert _rel(out[key], value) <= 1e-5, key
        cache = new_cache


def test_decode_is_prefill_at_t1(tiny):
    decode = import_model(tiny, "decode")
    verify(decode)
    assert all("T" not in free_symbols(d) for v in decode.values() for d in v.type.shape)
    assert decode.value("tokens").type.shape[1] == 1


def test_json_round_trip(tiny):
    g = import_model(tiny, "prefill")
    assert print_graph(serialize.loads(serialize.dumps(g))) == print_graph(g)


def test_layer_schedule_and_param_keys(tiny):
    cfg = tiny.config
    g = import_model(tiny, "prefill")
    layers_with = lambda op: sorted({n.meta["layer"] for n in g.nodes if n.op == op})  # noqa: E731
    assert layers_with("kda_recurrence") == sorted(cfg.kda_layers)
    assert layers_with("dsa_index_topk") == sorted(cfg.dsa_layers)
    assert layers_with("moe_experts") == [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    assert set(g.params) == {k for k, _ in tiny.named_parameters()}


@pytest.mark.parametrize("preset, pieces", [
    ("k3.1-pro-tiny", ["attn_res", "embed", "ffn/dense", "ffn/moe", "head", "mixer/dsa", "mixer/kda"]),
    ("kimi-linear-tiny", ["embed", "ffn/dense", "ffn/moe", "head", "mixer/kda", "mixer/mla"]),
])
def test_each_distinct_sublayer_is_exported_once(preset, pieces):
    """Layers share their mixers, MLPs and AttnRes reads: one export each, whatever the layer count."""
    assert sorted(export_segments(build_meta_model(preset))) == pieces


def test_segments_are_memoised_per_parameter_dtypes():
    """A checkpoint keeps some weights in f32 beside bf16 ones (the meta model of a preset does): an all-bf16
    model with the same config and lm_head dtype must not lend it its exports (types checked at import)."""
    mixed = build_meta_model("kimi-linear-tiny").cast_(torch.bfloat16)   # what `k3c compile --plan-only` imports
    dtypes = {p.dtype for p in mixed.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, dtypes
    uniform = K3ForCausalLM(K3Config.from_pretrained("kimi-linear-tiny")).to(torch.bfloat16)
    assert uniform.dtype == mixed.dtype
    import_model(uniform, "decode")
    g = import_model(mixed, "decode")
    assert {v.type.dtype for v in g.params.values()} == {"bf16", "f32"}


def test_unsupported_op_names_the_op_and_model_line(monkeypatch):
    model = K3ForCausalLM(K3Config.from_pretrained("kimi-linear-tiny"))
    import_model(model, "prefill")  # exports once (memoised)
    monkeypatch.delitem(fx_import._RULES, torch.ops.aten.silu.default)
    with pytest.raises(UnsupportedError, match=r"aten\.silu.*models/layers\.py:\d+"):
        import_model(model, "prefill")


@pytest.mark.slow
def test_full_k31_pro_imports_on_meta():
    """93 layers on the meta device: 69 KDA, 24 DSA (each with one indexer top-k), 92 MoE layers."""
    stats: dict = {}
    g = import_model("k3.1-pro", "prefill", stats=stats)
    ops = [n.op for n in g.nodes]
    assert ops.count("kda_recurrence") == 69
    assert ops.count("dsa_index_topk") == 24
    assert ops.count("moe_experts") == 92
    assert g.params["model.layers.4.block_sparse_moe.experts.w1"].type.shape == (896, 3072, 3584)
    assert g.value("layers.3.kv").type.shape[2] == 576
    verify(g)
