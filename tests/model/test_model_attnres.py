"""Block Attention Residuals: the sealing schedule of full K3, and the AttnRes formula against hand numbers."""

from __future__ import annotations

import math

import pytest
import torch

import models.k3
from models.config import K3Config, load_published
from models.layers import attn_res

# K3-SPEC.md "Decoder layer": for 93 layers with blocks of 12, blocks are sealed at layers 0, 12, ..., 84 and the
# final readout sees 9 sources (8 sealed blocks + the partial sum). Written out, not computed with `%`.
K3_SEALS = [0, 12, 24, 36, 48, 60, 72, 84]


def test_full_k3_schedule_from_config():
    cfg = K3Config.from_pretrained("k3")
    assert cfg.num_hidden_layers == 93 and cfg.attn_res_block_size == 12
    assert [i for i in range(cfg.num_hidden_layers) if cfg.seals_block(i)] == K3_SEALS
    assert cfg.num_attn_res_sources == 9
    assert K3Config.from_pretrained("k3.1-pro").num_attn_res_sources == 9
    lin = K3Config.from_pretrained("kimi-linear-48b")
    assert lin.attn_res_block_size is None and lin.num_attn_res_sources == 0
    assert not any(lin.seals_block(i) for i in range(lin.num_hidden_layers))


def _k3_schedule_tiny() -> K3Config:
    """Full K3's layer structure (93 layers, blocks of 12, its KDA / MLA lists) at tiny widths."""
    data = load_published("k3")
    text = data["text_config"]
    text.update(vocab_size=64, hidden_size=16, intermediate_size=16, num_experts=4, num_experts_per_token=2,
                moe_intermediate_size=8, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                qk_rope_head_dim=4, v_head_dim=4, routed_expert_hidden_size=8)
    text["linear_attn_config"].update(num_heads=2, head_dim=4)
    text.pop("quantization_config")
    return K3Config.from_dict(data, source="k3 schedule (tiny widths)")


def test_full_k3_schedule_by_running(monkeypatch):
    cfg = _k3_schedule_tiny()
    assert cfg.num_hidden_layers == 93 and cfg.attn_res_block_size == 12
    model = models.k3.K3ForCausalLM(cfg).init_random_(0)
    calls: list[torch.Tensor] = []

    def counting_attn_res(sources, proj_weight, norm_weight, eps):
        calls.append(sources.detach().clone())
        return attn_res(sources, proj_weight, norm_weight, eps)

    monkeypatch.setattr(models.k3, "attn_res", counting_attn_res)
    tokens = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        model(tokens)
    counts = [c.shape[0] for c in calls]
    assert len(counts) == 2 * 93 + 1  # attention-side and MLP-side read per layer, then the output readout
    attn_side, mlp_side, readout = counts[0:-1:2], counts[1:-1:2], counts[-1]
    for layer in range(93):
        sealed_before = sum(s < layer for s in K3_SEALS)
        sealed_incl = sum(s <= layer for s in K3_SEALS)
        assert attn_side[layer] == sealed_before + 1, layer  # the attention read happens before the layer seals
        assert mlp_side[layer] == sealed_incl + 1, layer  # ... and the MLP read after it
    assert readout == 9
    # layer 0 seals the embedding as b_0: every later read sees it as its first source, unchanged
    emb = model.model.embed_tokens.weight[tokens]
    assert torch.equal(calls[0][0], emb)
    assert all(torch.equal(c[0], emb) for c in calls[1:])
    # sealed blocks never change once sealed: the readout's 8 blocks are the blocks the last layer saw
    assert torch.equal(calls[-1][:8], calls[-2][:8])


def test_attn_res_two_sources_hand_computed():
    """V0 = [1, 1] (rms 1 -> key [1, 1]); V1 = [2, -2] (rms 2 -> key [1, -1]).
    w = norm.weight * proj.weight[0] = [2 * 0.3, 0.5 * ln 9] = [0.6, ln 3]:
    logits 0.6 + ln 3 and 0.6 - ln 3 differ by ln 9, so softmax = [9/10, 1/10];
    output = 0.9 * [1, 1] + 0.1 * [2, -2] = [1.1, 0.7]. (No 1/sqrt(d) scaling: with it the weights would differ.)"""
    V = torch.tensor([[1.0, 1.0], [2.0, -2.0]]).reshape(2, 1, 1, 2)
    norm_w = torch.tensor([2.0, 0.5])
    proj_w = torch.tensor([[0.3, math.log(9.0)]])
    out = attn_res(V, proj_w, norm_w, eps=0.0)
    assert out.shape == (1, 1, 2)
    assert torch.allclose(out.reshape(2), torch.tensor([1.1, 0.7]), atol=1e-6, rtol=0)
    # with the model's eps (1e-5) the keys barely move: still [1.1, 0.7] to 1e-5
    out = attn_res(V, proj_w, norm_w, eps=1e-5)
    assert torch.allclose(out.reshape(2), torch.tensor([1.1, 0.7]), atol=1e-5, rtol=0)
    # scaling a source does not change its key (RMS-normalised), only its value: V1 * 10 -> 0.9*[1,1] + 0.1*[20,-20]
    out = attn_res(V * torch.tensor([1.0, 10.0]).reshape(2, 1, 1, 1), proj_w, norm_w, eps=0.0)
    assert torch.allclose(out.reshape(2), torch.tensor([2.9, -1.1]), atol=1e-5, rtol=0)


def test_attn_res_one_source_is_identity_and_bf16_keeps_dtype():
    x = torch.randn(1, 2, 3, 8)
    assert torch.equal(attn_res(x, torch.randn(1, 8), torch.randn(8), 1e-5), x[0])
    xb = x.bfloat16()
    out = attn_res(torch.cat([xb, xb * 2]), torch.randn(1, 8), torch.ones(8), 1e-5)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-pro-tiny"])
def test_tiny_presets_readout_sources(preset, monkeypatch, tiny_model):
    """10 layers, blocks of 3: seals at 0, 3, 6, 9 -> 5 readout sources."""
    model = tiny_model(preset)
    assert model.config.num_attn_res_sources == 5
    seen = []
    monkeypatch.setattr(models.k3, "attn_res", lambda s, *a: (seen.append(s.shape[0]), attn_res(s, *a))[1])
    with torch.no_grad():
        model(torch.tensor([[3, 4]]))
    assert seen[-1] == 5 and seen[:2] == [1, 2]
