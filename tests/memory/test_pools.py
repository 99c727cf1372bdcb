"""Persistent pools against K3-SPEC.md "Sizes to check a memory plan against" (full K3.1 Pro, one sequence)."""

import pytest

from k3c.errors import ConfigError
from k3c.memory.pools import attn_res_sources, cache_pools, dtype_name, pools_total_bytes

MiB, KiB = 2**20, 2**10
# K3.1 Pro (configs/kimi-k3.1-pro.json): 93 layers, 69 KDA + 24 global (DSA), 96 KDA heads of 128,
# kv_lora_rank 512 + rope 64, indexer key 128, hidden 7168, AttnRes blocks of 12.
K31 = dict(kda_layers=69, kda_heads=96, kda_head_dim=128, global_layers=24, kv_lora_rank=512,
           qk_rope_head_dim=64, dsa_layers=24, index_head_dim=128)


def test_k31_pro_kda_state_bf16_is_207_mib():
    pools = cache_pools(max_batch=1, max_seq=1, state_dtype="bf16", **K31)
    assert pools["kda_state"].shape == (69, 1, 96, 128, 128)
    assert pools["kda_state"].nbytes == 69 * 96 * 128 * 128 * 2 == 217_055_232
    assert round(pools["kda_state"].nbytes / MiB) == 207
    # default fp32 state (K3-SPEC "KDA layer": state S is fp32) is twice that
    assert cache_pools(max_batch=1, max_seq=1, **K31)["kda_state"].nbytes == 2 * 217_055_232


def test_k31_pro_latent_kv_and_index_keys_at_1m_tokens():
    pools = cache_pools(max_batch=1, max_seq=1_000_000, **K31)
    kv = pools["mla_latent_kv"]
    assert kv.shape == (24, 1, 1_000_000, 576) and kv.dtype == "bfloat16"
    assert kv.nbytes // (24 * 1_000_000) == 1152  # 576 × 2 B per token per global layer
    assert kv.nbytes == 27_648_000_000  # "≈ 27.6 GB"
    keys = pools["dsa_index_keys"]
    assert keys.dtype == "float8_e4m3fn" and keys.nbytes // (24 * 1_000_000) == 128
    assert keys.nbytes == 3_072_000_000  # "≈ 3 GB"


def test_kda_conv_state_shape():
    conv = cache_pools(max_batch=2, max_seq=8, **K31)["kda_conv"]
    assert conv.shape == (69, 2, 3 * 96 * 128, 4) and conv.nbytes == 69 * 2 * 36864 * 4 * 2


def test_attn_res_blocks_126_kib_per_token():
    assert attn_res_sources(93, 12) == 9  # blocks sealed at 0, 12, ..., 84 plus the partial sum
    assert attn_res_sources(12, 12) == 2 and attn_res_sources(13, 12) == 3
    pools = cache_pools(max_batch=1, max_seq=1, attn_res_sources=9, hidden_size=7168, max_tokens_in_flight=1)
    assert pools["attn_res_blocks"].nbytes == 9 * 7168 * 2 == 126 * KiB
    assert list(pools) == ["attn_res_blocks"]


def test_batch_scales_linearly_and_total():
    one = cache_pools(max_batch=1, max_seq=4096, **K31)
    four = cache_pools(max_batch=4, max_seq=4096, **K31)
    assert all(four[k].nbytes == 4 * one[k].nbytes for k in one)
    assert pools_total_bytes(one) == sum(p.nbytes for p in one.values())
    assert one["kda_state"].to_json()["shape"] == [69, 1, 96, 128, 128]


def test_kimi_linear_has_no_dsa_or_attn_res():
    pools = cache_pools(max_batch=1, max_seq=1024, kda_layers=20, kda_heads=32, kda_head_dim=128,
                        global_layers=7, kv_lora_rank=512, qk_rope_head_dim=64)
    assert list(pools) == ["kda_state", "kda_conv", "mla_latent_kv"]


@pytest.mark.parametrize("kw, match", [
    (dict(max_batch=0, max_seq=1), "max_batch"),
    (dict(max_batch=1, max_seq=1, kda_layers=2), "kda_heads"),
    (dict(max_batch=1, max_seq=1, global_layers=-1), "global_layers"),
    (dict(max_batch=1, max_seq=1, kda_layers=1, kda_heads=1, kda_head_dim=1, state_dtype="fp7"), "fp7"),
])
def test_bad_arguments_raise_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        cache_pools(**kw)


def test_dtype_aliases():
    assert dtype_name("torch.bfloat16") == dtype_name("bf16") == "bfloat16"
    assert dtype_name("fp8") == "float8_e4m3fn"
