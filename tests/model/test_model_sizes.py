"""Full-size configs build on the meta device; parameter counts of full K3 from the config, by hand."""

from __future__ import annotations

import pytest
import torch

from models.config import K3Config
from models.k3 import K3ForCausalLM


def _meta(name: str) -> K3ForCausalLM:
    with torch.device("meta"):
        return K3ForCausalLM(K3Config.from_pretrained(name))


def _params_by_hand(c: K3Config) -> tuple[int, int]:
    """(total, one routed expert) parameter counts from the config fields and K3-SPEC.md's layer formulas."""
    D, V = c.hidden_size, c.vocab_size
    H, K, W = c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size
    kda = (3 * D * H * K  # q, k, v projections
           + 3 * H * K * W  # depthwise convs [C, 1, W]
           + D * K + K * H * K  # f_a_proj, f_b_proj (rank K)
           + D * H  # b_proj
           + (D * H * K if c.use_full_rank_gate else D * K + K * H * K)  # g_proj / g_a_proj + g_b_proj
           + H + H * K + K  # A_log, dt_bias, o_norm
           + H * K * D)  # o_proj
    A, nope, rope, vd, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    q = D * A * (nope + rope) if c.q_lora_rank is None else D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * A * (nope + rope)
    mla = q + D * (r + rope) + r + r * A * (nope + vd) + (D * A * vd if c.mla_use_output_gate else 0) + A * vd * D
    dsa_extra = (c.q_lora_rank * c.index_num_heads * c.index_head_dim + D * c.index_head_dim + 2 * c.index_head_dim
                 + D * c.index_num_heads) if c.index_topk else 0
    Dl, I, E = c.routed_expert_hidden_size or D, c.moe_intermediate_size, c.num_experts
    expert = 3 * I * Dl
    moe = E * D + E + E * expert + 3 * D * I * c.num_shared_experts
    if c.routed_expert_hidden_size:
        moe += 2 * D * Dl + Dl  # routed_expert_down_proj, _up_proj, routed_expert_norm
    dense = 3 * D * c.intermediate_size
    per_layer_norms = 2 * D + (4 * D if c.attn_res_block_size else 0)  # 2 RMSNorms (+ 2 AttnRes proj + norm pairs)
    total = 2 * V * D + D + (2 * D if c.attn_res_block_size else 0)  # embed, lm_head, norm (+ output AttnRes)
    for i in range(c.num_hidden_layers):
        kind = c.layer_kind(i)
        total += per_layer_norms + (kda if kind == "kda" else mla + (dsa_extra if kind == "dsa" else 0))
        total += moe if c.is_moe(i) else dense
    return total, expert


@pytest.mark.parametrize("name", ["k3", "k3.1-pro", "kimi-linear-48b"])
def test_full_configs_build_on_meta_and_match_hand_count(name):
    model = _meta(name)
    assert all(p.is_meta for p in model.parameters())
    counted = sum(p.numel() for p in model.parameters())
    assert counted == _params_by_hand(model.config)[0]


def test_full_k3_parameter_count():
    """Computed: 2,779,484,476,000 parameters. The published figure "2.8T" is this number rounded to two
    significant digits, so the tolerance is that rounding: 2.75T <= total < 2.85T; the exact value is pinned too
    (any change to the layer structure moves it by >= 7168 parameters)."""
    model = _meta("k3")
    total = sum(p.numel() for p in model.parameters())
    assert total == 2_779_484_476_000
    assert 2.75e12 <= total < 2.85e12


def test_full_k3_active_parameters():
    """Active per token = total - (num_experts - num_experts_per_token) routed experts in each MoE layer.
    One expert is 3 x 3072 x 3584 = 33,030,144; 92 MoE layers x 880 unused experts = 2,674,120,458,240 unused, so
    105,364,017,760 active (105.4B) of which 2 x 163840 x 7168 = 2,348,810,240 are the embedding and lm_head.
    The published "≈104B" matches the active count without the input embedding lookup (104.19B; the
    embedding is a table read, not compute): 105.36B - 1.17B. Tolerance: the figure's rounding, ±0.5B."""
    cfg = K3Config.from_pretrained("k3")
    total, expert = _params_by_hand(cfg)
    assert expert == 33_030_144
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    active = total - n_moe * (cfg.num_experts - cfg.num_experts_per_token) * expert
    assert active == 105_364_017_760
    active_without_embedding = active - cfg.vocab_size * cfg.hidden_size
    assert abs(active_without_embedding - 104e9) <= 0.5e9, active_without_embedding


def test_k31_pro_adds_only_the_indexers():
    k3, pro = _params_by_hand(K3Config.from_pretrained("k3"))[0], _params_by_hand(K3Config.from_pretrained("k3.1-pro"))[0]
    # 24 indexers of wq_b 1536 x 4096 + wk 7168 x 128 + k_norm 2 x 128 + weights_proj 7168 x 32
    assert pro - k3 == 24 * (1536 * 32 * 128 + 7168 * 128 + 256 + 7168 * 32)
    assert sum(p.numel() for p in _meta("k3.1-pro").parameters()) == pro


def test_kimi_linear_is_48b():
    """Computed: 49,122,681,728 in all; 48,367,706,240 without the embedding and lm_head (2 x 163840 x 2304),
    which is the "48B" of the name (rounding: ±0.5B)."""
    cfg = K3Config.from_pretrained("kimi-linear-48b")
    total = sum(p.numel() for p in _meta("kimi-linear-48b").parameters())
    assert total == _params_by_hand(cfg)[0] == 49_122_681_728
    assert abs(total - 2 * cfg.vocab_size * cfg.hidden_size - 48e9) <= 0.5e9
