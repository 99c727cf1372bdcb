"""K3Config: the published configs parse with the right layer schedule; bad configs give ConfigError naming the field."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from k3c.errors import ConfigError
from models.config import CONFIG_DIR, PRESETS, PUBLISHED, TINY_PRESETS, K3Config, load_published

SHARED = Path("/work/shared/configs")


@pytest.mark.parametrize("fname", sorted(PUBLISHED.values()))
def test_published_config_parses_and_matches_shared_copy(fname):
    path = CONFIG_DIR / fname
    cfg = K3Config.from_pretrained(path)
    assert cfg.num_hidden_layers > 0
    if SHARED.is_dir():
        assert path.read_bytes() == (SHARED / fname).read_bytes(), f"models/configs/{fname} differs from {SHARED}"


def test_every_shipped_config_is_published():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.json")) == sorted(PUBLISHED.values())


def _kinds(cfg):
    return [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]


def test_full_k3_schedule():
    cfg = K3Config.from_pretrained("k3")
    kinds = _kinds(cfg)
    assert cfg.num_hidden_layers == 93
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24 and kinds.count("dsa") == 0
    # 1-based lists: layers 4, 8, ..., 92 and 93 are global; 0-based that is 3, 7, ..., 91, 92
    assert [i for i, k in enumerate(kinds) if k == "mla"] == list(range(3, 92, 4)) + [92]
    assert kinds[0] == "kda" and kinds[3] == "mla"
    assert sum(cfg.is_moe(i) for i in range(93)) == 92 and not cfg.is_moe(0)
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate and cfg.attn_res_block_size == 12
    assert cfg.expert_quantization == "mxfp4" and cfg.checkpoint_prefix == "language_model."
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (896, 16, 2)
    assert cfg.routed_expert_hidden_size == 3584 and cfg.mla_cache_width == 576
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size) == (96, 128, 4)
    assert cfg.hidden_act == "situ" and (cfg.situ_beta, cfg.situ_linear_beta) == (4.0, 25.0)


def test_k31_pro_schedule():
    cfg = K3Config.from_pretrained("k3.1-pro")
    kinds = _kinds(cfg)
    assert kinds.count("dsa") == 24 and kinds.count("kda") == 69 and kinds.count("mla") == 0
    assert (cfg.index_num_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert sum(cfg.is_moe(i) for i in range(93)) == 92


def test_kimi_linear_schedule():
    cfg = K3Config.from_pretrained("kimi-linear-48b")
    kinds = _kinds(cfg)
    assert cfg.num_hidden_layers == 27 and kinds.count("kda") == 20 and kinds.count("mla") == 7
    assert cfg.attn_res_block_size is None and cfg.num_attn_res_sources == 0
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate
    assert cfg.checkpoint_prefix == "" and cfg.q_lora_rank is None and cfg.hidden_act == "silu"
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (256, 8, 1)
    assert cfg.routed_expert_hidden_size is None and cfg.routed_scaling_factor == 2.446


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_parse(name):
    cfg = K3Config.from_pretrained(name)
    assert cfg.name == name and cfg.hidden_size == 64
    assert set(PRESETS) >= set(TINY_PRESETS)


# ---- errors ----------------------------------------------------------------------------------------------------
def _k3():
    return load_published("k3")


def _expect_error(data, *fragments, source="cfg.json"):
    with pytest.raises(ConfigError) as e:
        K3Config.from_dict(data, source=source)
    msg = str(e.value)
    for frag in (source, *fragments):
        assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


def test_missing_field_names_its_path():
    data = _k3()
    del data["text_config"]["linear_attn_config"]["head_dim"]
    _expect_error(data, "text_config.linear_attn_config.head_dim", "missing")
    data = _k3()
    del data["text_config"]["hidden_size"]
    _expect_error(data, "text_config.hidden_size")
    data = load_published("kimi-linear-48b")  # flat layout: no text_config. prefix
    del data["linear_attn_config"]["num_heads"]
    msg = _expect_error(data, "linear_attn_config.num_heads")
    assert "text_config" not in msg
    data = _k3()
    del data["text_config"]
    _expect_error(data, "text_config")


@pytest.mark.parametrize("field,value", [("head_dim", "128"), ("head_dim", 128.0), ("head_dim", True), ("head_dim", -4),
                                         ("head_dim", None), ("short_conv_kernel_size", [4])])
def test_wrong_type_names_its_path(field, value):
    data = _k3()
    data["text_config"]["linear_attn_config"][field] = value
    _expect_error(data, f"text_config.linear_attn_config.{field}")


@pytest.mark.parametrize("field,value", [("vocab_size", "big"), ("rms_norm_eps", "1e-5"), ("tie_word_embeddings", 0),
                                         ("hidden_act", "gelu"), ("attn_res_block_size", 0), ("num_experts", 2.5),
                                         ("hidden_size", 10 ** 30), ("hidden_size", 2 ** 31),
                                         ("rms_norm_eps", float("inf")), ("routed_scaling_factor", float("nan")),
                                         ("rms_norm_eps", 10 ** 400)])
def test_wrong_value_of_text_fields(field, value):
    data = _k3()
    data["text_config"][field] = value
    _expect_error(data, f"text_config.{field}")


def test_wrong_nested_object_type():
    data = _k3()
    data["text_config"]["linear_attn_config"] = [1, 2]
    _expect_error(data, "text_config.linear_attn_config")
    with pytest.raises(ConfigError):
        K3Config.from_dict([], source="cfg.json")


@pytest.mark.parametrize("mutate,field", [
    (lambda lin: lin["kda_layers"].append(0), "kda_layers"),  # 0 in a 1-based list
    (lambda lin: lin["kda_layers"].append(94), "kda_layers"),  # past the last layer
    (lambda lin: lin["kda_layers"].append(1), "kda_layers"),  # duplicate
    # coverage errors name both lists: "text_config.linear_attn_config.kda_layers and full_attn_layers ..."
    (lambda lin: lin["full_attn_layers"].append(1), "kda_layers and full_attn_layers"),  # in both lists
    (lambda lin: lin["full_attn_layers"].remove(93), "kda_layers and full_attn_layers"),  # a layer in neither list
    (lambda lin: lin.__setitem__("kda_layers", [1, "2"]), "kda_layers"),  # not ints
])
def test_bad_layer_lists(mutate, field):
    data = _k3()
    mutate(data["text_config"]["linear_attn_config"])
    _expect_error(data, f"text_config.linear_attn_config.{field}")


def test_bad_dsa_layers():
    data = load_published("k3.1-pro")
    data["text_config"]["dsa_config"]["dsa_layers"].append(1)  # layer 1 is KDA, not global
    _expect_error(data, "text_config.dsa_config.dsa_layers")
    data = load_published("k3.1-pro")
    del data["text_config"]["dsa_config"]["index_topk"]
    _expect_error(data, "text_config.dsa_config.index_topk")


def test_gate_lower_bound_must_be_negative():
    data = _k3()
    data["text_config"]["linear_attn_config"]["gate_lower_bound"] = 5.0
    _expect_error(data, "text_config.linear_attn_config.gate_lower_bound")


def test_from_pretrained_missing_path(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError, match="nope"):
        K3Config.from_pretrained(missing)
    with pytest.raises(ConfigError, match="empty_dir"):  # a directory without config.json
        (tmp_path / "empty_dir").mkdir()
        K3Config.from_pretrained(tmp_path / "empty_dir")
    with pytest.raises(ConfigError, match="k3-huge"):
        K3Config.from_pretrained("k3-huge")


def test_from_pretrained_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "kimi_k3", "text_config": {')
    with pytest.raises(ConfigError) as e:
        K3Config.from_pretrained(path)
    assert str(path) in str(e.value) and "JSON" in str(e.value)
    with pytest.raises(ConfigError) as e:  # through the checkpoint directory form too
        K3Config.from_pretrained(tmp_path)
    assert str(path) in str(e.value)


def test_config_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'config.json'}: not UTF-8 text \\(byte 0xff at offset 0\\)"):
        K3Config.from_pretrained(tmp_path)


@pytest.mark.parametrize("text", [b"[" * 100000, b'{"text_config": {"hidden_size": ' + b"9" * 5000 + b"}}"])
def test_config_json_python_cannot_hold_is_named(tmp_path, text):
    # nesting deeper than Python's recursion limit; an integer of more than 4300 digits (int's string limit)
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'config.json'}: not a config JSON file"):
        K3Config.from_pretrained(tmp_path)


def test_a_config_file_names_the_model_by_its_own_name(tmp_path):
    (tmp_path / "mine.json").write_text(json.dumps(_k3()))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps(_k3()))
    assert K3Config.from_pretrained(tmp_path / "mine.json").name == "mine"
    assert K3Config.from_pretrained(tmp_path / "ck").name == "ck"
    assert K3Config.from_pretrained(tmp_path / "ck" / "config.json").name == "ck"


def test_checkpoint_directory_without_config_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"{tmp_path}: a checkpoint directory needs a config.json"):
        K3Config.from_pretrained(tmp_path)


def test_a_missing_path_and_an_empty_name_are_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}/none/config.json: no such file or directory"):
        K3Config.from_pretrained(tmp_path / "none" / "config.json")
    with pytest.raises(ConfigError, match="model '': expected a preset .*k3-tiny.*, a config.json or a checkpoint"):
        K3Config.from_pretrained("")
    with pytest.raises(ConfigError, match="no-such-model: not a preset"):        # a bare name: a preset mistyped
        K3Config.from_pretrained("no-such-model")


def test_from_pretrained_field_error_names_the_file(tmp_path):
    data = _k3()
    data["text_config"]["linear_attn_config"]["head_dim"] = "x"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        K3Config.from_pretrained(tmp_path)
    assert str(path) in str(e.value) and "text_config.linear_attn_config.head_dim" in str(e.value)


def test_config_round_trip_through_file(tmp_path):
    data = _k3()
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert dataclasses.replace(K3Config.from_pretrained(tmp_path), name="k3") == K3Config.from_pretrained("k3")
    assert K3Config.from_pretrained(tmp_path).raw == data and data == copy.deepcopy(_k3())
