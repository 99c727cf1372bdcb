"""Checkpoints: save_random_checkpoint -> load_checkpoint round trip, determinism, MXFP4, key layout, errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3c.errors import CheckpointError
from models.checkpoint import (E2M1_VALUES, expected_tensors, load_checkpoint, load_mxfp4_experts, mxfp4_dequantize,
                               mxfp4_nonfinite, mxfp4_quantize, quantize_experts_, save_random_checkpoint)
from models.layers import FP32_PARAM_SUFFIXES

SHARD = 256 * 1024  # small shards so a tiny model spans several files
TOKENS = torch.tensor([[1, 7, 300, 42, 9, 511, 0], [5, 5, 5, 64, 128, 256, 3]])


def _logits(model):
    with torch.no_grad():
        return model(TOKENS)[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, fmt in [("k3-tiny", "dense"), ("k3-tiny", "mxfp4"), ("kimi-linear-tiny", "dense")]:
        path = root / f"{name}-{fmt}"
        model = save_random_checkpoint(name, path, seed=3, expert_format=fmt, shard_bytes=SHARD)
        out[name, fmt] = (path, model, _logits(model))
    return out


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(path: Path, edit) -> None:
    """Apply `edit(dict)` to every shard of `path` and rewrite the index to match."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(f))
        edit(tensors)
        save_file(tensors, str(f), metadata={"format": "pt"})
        weight_map.update({k: f.name for k in tensors})
    index["weight_map"] = weight_map
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture
def dense_copy(ckpts, tmp_path):
    src = ckpts["k3-tiny", "dense"][0]
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


# ---- round trip ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [("k3-tiny", "dense"), ("k3-tiny", "mxfp4"), ("kimi-linear-tiny", "dense")])
def test_round_trip_identical_logits(ckpts, key):
    path, model, want = ckpts[key]
    files = sorted(p.name for p in path.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files and "config.json" in files
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(shards)
    tensors = _all_tensors(path)
    assert set(index) == set(tensors)
    # the layout of the config: every expected key present with its shape and storage dtype
    loaded = load_checkpoint(path)
    exp = expected_tensors(loaded.config)
    assert set(exp) == set(tensors)
    for k, t in tensors.items():
        assert tuple(t.shape) == exp[k][0], k
        if k.endswith(("weight_packed", "weight_scale")):
            assert t.dtype == torch.uint8
        elif k.endswith(FP32_PARAM_SUFFIXES):
            assert t.dtype == torch.float32, k
        else:
            assert t.dtype == torch.bfloat16, k  # bf16 storage
    got = _logits(loaded)
    assert torch.equal(got, want)  # exactly: the returned model holds what was stored
    # and the returned model's weights are bf16 values (not the fp32 init the checkpoint could not hold)
    for n, p in model.named_parameters():
        if not n.endswith(FP32_PARAM_SUFFIXES):
            assert torch.equal(p, p.bfloat16().float()), n


def test_mxfp4_experts_are_quantized(ckpts):
    path, model, _ = ckpts["k3-tiny", "mxfp4"]
    tensors = _all_tensors(path)
    packed = [k for k in tensors if k.endswith("weight_packed")]
    assert packed and not any(k.endswith("experts.0.w1.weight") for k in tensors)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    # dense and mxfp4 differ only by expert rounding (same seed): the logits are close but not equal
    dense = ckpts["k3-tiny", "dense"][2]
    mx = ckpts["k3-tiny", "mxfp4"][2]
    assert not torch.equal(dense, mx)
    # the returned model's experts are exactly the stored codes, decoded by hand from the E2M1 table
    k = "language_model.model.layers.1.block_sparse_moe.experts.2.w3"
    codes = torch.stack([tensors[k + ".weight_packed"] & 15, tensors[k + ".weight_packed"] >> 4], -1).flatten(1).long()
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    scale = 2.0 ** (tensors[k + ".weight_scale"].double() - 127)
    want = table[codes].double() * scale.repeat_interleave(32, 1)
    assert torch.equal(model.model.layers[1].block_sparse_moe.experts.w3[2].double(), want)


def test_load_mxfp4_experts_returns_the_stored_bits(ckpts):
    """Stacked over experts under the model's parameter keys, bit for bit the stored tensors; and quantize_experts_
    is what save_random_checkpoint stored (the same model values, the same bits)."""
    path, model, _ = ckpts["k3-tiny", "mxfp4"]
    got = load_mxfp4_experts(path)
    tensors = _all_tensors(path)
    E = model.config.num_experts
    assert len(got) == 6 * sum(model.config.is_moe(i) for i in range(model.config.num_hidden_layers))
    for k, t in got.items():
        base, suffix = k.rsplit(".", 1)
        layer, w = base.rsplit(".experts.", 1)
        per = [tensors[f"language_model.{layer}.experts.{e}.{w}.{suffix}"] for e in range(E)]
        assert torch.equal(t, torch.stack(per)), k
    again = save_random_checkpoint("k3-tiny", path.parent / "again", seed=3, expert_format="dense", shard_bytes=SHARD)
    packed = quantize_experts_(again)
    assert set(packed) == set(got) and all(torch.equal(packed[k], got[k]) for k in got)
    for n, p in again.named_parameters():
        assert torch.equal(p, model.get_parameter(n)), n


def test_load_mxfp4_experts_of_a_dense_checkpoint_is_an_error(ckpts):
    with pytest.raises(CheckpointError, match="no MXFP4 quantization_config"):
        load_mxfp4_experts(ckpts["k3-tiny", "dense"][0])


def test_deterministic_bytes(tmp_path, ckpts):
    a = save_random_checkpoint("k3-tiny", tmp_path / "a", seed=3, expert_format="mxfp4", shard_bytes=SHARD)
    save_random_checkpoint("k3-tiny", tmp_path / "b", seed=3, expert_format="mxfp4", shard_bytes=SHARD)
    save_random_checkpoint("k3-tiny", tmp_path / "c", seed=4, expert_format="mxfp4", shard_bytes=SHARD)

    def digest(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digest(tmp_path / "a") == digest(tmp_path / "b") == digest(ckpts["k3-tiny", "mxfp4"][0])
    assert digest(tmp_path / "a") != digest(tmp_path / "c")
    assert torch.equal(_logits(a), ckpts["k3-tiny", "mxfp4"][2])


# ---- MXFP4 by hand -------------------------------------------------------------------------------------------
def test_e2m1_table():
    # OCP MX v1.0 FP4 E2M1: bias 1, codes 0..7 = 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6
    assert E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0] * 8], dtype=torch.uint8)
    want = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6] + [0.0] * 16
    got = mxfp4_dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert got.tolist() == [want]
    assert torch.signbit(got[0, 8]) and not torch.signbit(got[0, 0])  # code 8 is -0
    assert mxfp4_dequantize(packed, torch.tensor([[129]], dtype=torch.uint8)).tolist() == [[4 * v for v in want]]
    assert mxfp4_dequantize(packed, torch.tensor([[125]], dtype=torch.uint8)).tolist() == [[v / 4 for v in want]]


def test_mxfp4_quantize_hand_bytes():
    """Element 2j in the low nibble, 2j+1 in the high one; E8M0 scale byte s + 127 with s the smallest exponent
    such that amax / 2^s <= 6."""
    w = torch.zeros(3, 64)
    # row 0, group 0: amax 6 -> s = 0 (byte 127). codes: 0.5->1, -1->10, 6->7, 0->0, 1.5->3, -3->13,
    # 0.7->1 (nearer 0.5 than 1), 5.1->7 (nearer 6 than 4)
    w[0, :8] = torch.tensor([0.5, -1.0, 6.0, 0.0, 1.5, -3.0, 0.7, 5.1])
    # row 0, group 1: amax 12 -> s = 1 (byte 128): 12/2 = 6 -> 7, -8/2 = -4 -> 14
    w[0, 32:34] = torch.tensor([12.0, -8.0])
    # row 1: amax 3 -> s = -1 (byte 126): 3*2 = 6 -> 7, -0.25*2 = -0.5 -> 9, 0.75*2 = 1.5 -> 3, 2*2 = 4 -> 6
    w[1, :4] = torch.tensor([3.0, -0.25, 0.75, 2.0])
    # row 1 group 1: amax 6.5 -> s = 1 (6.5/2 = 3.25 -> 3, code 5); 1.0/2 = 0.5 -> code 1
    w[1, 32:34] = torch.tensor([6.5, 1.0])
    # row 2: all zero: codes 0
    packed, scale = mxfp4_quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 32) and scale.shape == (3, 2)
    assert packed[0, :4].tolist() == [0xA1, 0x07, 0xD3, 0x71] and packed[0, 4:16].tolist() == [0] * 12
    assert packed[0, 16] == 0xE7 and packed[0, 17:].tolist() == [0] * 15
    assert packed[1, :2].tolist() == [0x97, 0x63] and packed[1, 16] == 0x15
    assert packed[2].tolist() == [0] * 32
    assert scale[0].tolist() == [127, 128] and scale[1].tolist() == [126, 128]
    deq = mxfp4_dequantize(packed, scale)
    assert deq[0, :8].tolist() == [0.5, -1.0, 6.0, 0.0, 1.5, -3.0, 0.5, 6.0]
    assert deq[0, 32:34].tolist() == [12.0, -8.0] and deq[1, :4].tolist() == [3.0, -0.25, 0.75, 2.0]
    assert deq[1, 32:34].tolist() == [6.0, 1.0]


def test_mxfp4_round_trip_of_representable_values():
    gen = torch.Generator().manual_seed(0)
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6])
    w = table[torch.randint(0, 15, (4, 96), generator=gen)]
    w[:, ::32] = 6.0  # amax 6 in every group -> scale 2^0 ...
    w = w * torch.tensor([0.25, 1.0, 8.0, 2.0 ** -20])[:, None]  # ... times a power of two per row
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(w)), w)
    with pytest.raises(CheckpointError):
        mxfp4_quantize(torch.zeros(2, 30))


# ---- key layout ------------------------------------------------------------------------------------------------
def test_prefixes(ckpts):
    k3 = _all_tensors(ckpts["k3-tiny", "dense"][0])
    assert all(k.startswith("language_model.") for k in k3)
    assert "language_model.model.layers.0.self_attn.q_conv1d.weight" in k3
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in k3
    assert "language_model.model.output_attn_res_proj.weight" in k3
    lin = _all_tensors(ckpts["kimi-linear-tiny", "dense"][0])
    assert not any(k.startswith("language_model.") for k in lin)
    assert "model.layers.0.self_attn.g_a_proj.weight" in lin and "lm_head.weight" in lin


@pytest.mark.parametrize("key", [("k3-tiny", "dense"), ("kimi-linear-tiny", "dense")])
def test_vision_and_other_keys_are_ignored(ckpts, key, tmp_path):
    src, _, want = ckpts[key]
    path = tmp_path / "with_vision"
    shutil.copytree(src, path)
    extra = {"vision_tower.patch_embed.weight": torch.randn(8, 3, 2, 2).bfloat16(),
             "mm_projector.linear_1.weight": torch.randn(4, 4).bfloat16()}
    if key[0].startswith("k3"):
        extra["language_model_unrelated.weight"] = torch.randn(2)  # not under the language_model. prefix
    save_file(extra, str(path / "vision.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "vision.safetensors" for k in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(_logits(load_checkpoint(path)), want)


def test_a_log_stored_longer_than_heads(ckpts, tmp_path):
    """Kimi Linear publishes A_log as [1, 1, H, 1]; a zero-padded longer A_log uses its first H entries."""
    src, _, want = ckpts["kimi-linear-tiny", "dense"]
    for i, shape_fn in enumerate([lambda t: t.reshape(1, 1, -1, 1), lambda t: torch.cat([t, torch.zeros(3)])]):
        path = tmp_path / f"alog{i}"
        shutil.copytree(src, path)
        _rewrite(path, lambda ts: ts.update({k: shape_fn(v) for k, v in ts.items() if k.endswith("A_log")}))
        assert torch.equal(_logits(load_checkpoint(path)), want)


def test_load_dtype_keeps_fp32_parameters(ckpts):
    model = load_checkpoint(ckpts["k3-tiny", "dense"][0], dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if n.endswith(FP32_PARAM_SUFFIXES) else torch.bfloat16), n


# ---- errors ----------------------------------------------------------------------------------------------------
KEY = "language_model.model.layers.2.self_attn.k_proj.weight"  # [H*K, D] = [64, 64] in k3-tiny
KEY_B = "language_model.model.layers.2.self_attn.b_proj.weight"  # [H, D] = [4, 64]


def _error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    return str(e.value)


def test_missing_tensor(dense_copy):
    _rewrite(dense_copy, lambda ts: ts.pop(KEY_B, None))
    msg = _error(dense_copy)
    assert KEY_B in msg and "[4, 64]" in msg


def test_extra_tensor(dense_copy):
    bogus = "language_model.model.layers.0.self_attn.bogus_proj.weight"
    _rewrite(dense_copy, lambda ts: ts.update({bogus: torch.zeros(3, 5)}) if KEY in ts else None)
    msg = _error(dense_copy)
    assert bogus in msg and "[3, 5]" in msg


def test_misshaped_tensor(dense_copy):
    _rewrite(dense_copy, lambda ts: ts.update({KEY_B: ts[KEY_B][:, :32].contiguous()}) if KEY_B in ts else None)
    msg = _error(dense_copy)
    assert KEY_B in msg and "[4, 32]" in msg and "[4, 64]" in msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights(dense_copy, bad):
    def poison(ts):
        if KEY in ts:
            t = ts[KEY].clone()
            t[3, 7] = bad
            ts[KEY] = t

    _rewrite(dense_copy, poison)
    msg = _error(dense_copy)
    assert KEY in msg and ("NaN" in msg or "Inf" in msg)


def test_mxfp4_scales_that_make_a_value_nan_or_inf(ckpts, tmp_path):
    # E8M0 byte 255 is NaN (OCP MX v1.0), and 2^(s - 127) times an E2M1 magnitude overflows f32 and bf16 at
    # 2^128: s = 254 with magnitudes 2 and up, 253 with 4 and up. Both loaders refuse such a group by its scale
    # tensor, as they refuse a NaN in a dense tensor; the same bytes with small magnitudes load
    path = tmp_path / "mx"
    shutil.copytree(ckpts["k3-tiny", "mxfp4"][0], path)
    packed_key = next(k for k in _all_tensors(path) if k.endswith("experts.3.w2.weight_packed"))
    scale_key = packed_key.replace("weight_packed", "weight_scale")
    stacked = packed_key.removeprefix("language_model.").replace(".experts.3.", ".experts.")   # expert 3 of it

    def set_group(scale, byte):     # row 1, group 0: scale byte, every pair of its 32 codes = `byte`
        def edit(ts):
            if scale_key in ts:
                t = ts[scale_key].clone()
                t[1, 0] = scale
                ts[scale_key] = t
            if packed_key in ts:
                t = ts[packed_key].clone()
                t[1, :16] = byte
                ts[packed_key] = t
        return edit

    # (scale byte, both codes of each byte: 0x33 = +1.5, 0x44 = +2, 0x55 = +3, 0x66 = +4, 0x8F = -6 and 0) -> bad
    for scale, byte, bad in ((255, 0x00, 32), (254, 0x33, 0), (254, 0x44, 32), (253, 0x55, 0), (253, 0x66, 32),
                             (253, 0x8F, 16), (252, 0x77, 0)):
        _rewrite(path, set_group(scale, byte))
        if bad:
            msg = _error(path)
            assert scale_key in msg and packed_key in msg and f"makes {bad} value(s)" in msg, msg
            with pytest.raises(CheckpointError, match=f"'{scale_key}' makes {bad} value"):
                load_mxfp4_experts(path)
        else:
            assert load_mxfp4_experts(path)[stacked.replace("packed", "scale")][3, 1, 0] == scale
            assert torch.isfinite(next(p for n, p in load_checkpoint(path).named_parameters()
                                       if n == stacked.removesuffix(".weight_packed"))).all()


def test_mxfp4_experts_need_rows_in_groups_of_32(tmp_path):
    # a config whose expert rows are not whole 32-value groups: the error names the matrix, its row length and the
    # way out, and nothing is written
    from models.config import K3Config

    raw = json.loads(json.dumps(K3Config.from_pretrained("k3-tiny").raw))
    raw["text_config"]["moe_intermediate_size"] = 48
    cfg = K3Config.from_dict(raw, source="test", name="k3-tiny-48")
    with pytest.raises(CheckpointError, match=r"experts\.w2 \[\d+, \d+, 48\].*moe_intermediate_size.*are 48 long; "
                                              r"use dense experts \(--experts-dtype bf16\)"):
        save_random_checkpoint(cfg, tmp_path / "c", expert_format="mxfp4")
    assert not (tmp_path / "c").exists()


def test_mxfp4_nonfinite_counts_what_dequantizing_makes_non_finite():
    # against the reference decoding in f32 (`mxfp4_dequantize`), over random codes and the scale bytes near the top
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=gen)
    scale = torch.randint(248, 256, (64, 4), dtype=torch.uint8, generator=gen)
    want = int((~torch.isfinite(mxfp4_dequantize(packed, scale))).sum())
    assert want > 0 and mxfp4_nonfinite(packed, scale) == want
    assert mxfp4_nonfinite(packed, scale.clamp(max=252)) == 0


def test_missing_shard(dense_copy):
    index = json.loads((dense_copy / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index[KEY]
    (dense_copy / shard).unlink()
    msg = _error(dense_copy)
    assert shard in msg



@pytest.mark.parametrize("edit", ["moved", "unlisted"])
def test_index_that_misplaces_a_tensor(dense_copy, edit):
    # the index's weight_map must say where each tensor is: one that names the wrong shard (or omits the tensor)
    # is named with the index file, as a reader that opens one tensor through the index would otherwise miss it
    path = dense_copy / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shard = index["weight_map"][KEY]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != shard)
    if edit == "moved":
        index["weight_map"][KEY] = other
    else:
        del index["weight_map"][KEY]
    path.write_text(json.dumps(index))
    msg = _error(dense_copy)
    assert "model.safetensors.index.json" in msg and KEY in msg and shard in msg


@pytest.mark.parametrize("name", ["../other/{shard}", "sub/{shard}", "..", ""])
def test_index_that_points_outside_the_directory(dense_copy, name):
    # a shard is a file of the checkpoint directory: a path in the weight_map is refused by name, before any
    # shard is opened (with "../", a shard of another checkpoint could be read)
    path = dense_copy / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"][KEY] = name.format(shard=index["weight_map"][KEY])
    path.write_text(json.dumps(index))
    msg = _error(dense_copy)
    assert f"{path}: weight_map maps '{KEY}' to {index['weight_map'][KEY]!r}; shard names are plain file names" in msg


def test_cli_dtype_detection_names_a_misplaced_embedding(dense_copy, tmp_path):
    # `k3c compile` without --dtype reads the embedding's dtype through the index: a wrong shard there is a
    # CheckpointError naming the index, the tensor and the shard, not a safetensors error
    from k3c.cli.build import _checkpoint_dtype

    path = dense_copy / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    key = next(k for k in index["weight_map"] if k.endswith("embed_tokens.weight"))
    index["weight_map"][key] = next(f for f in sorted(set(index["weight_map"].values()))
                                    if f != index["weight_map"][key])
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index\.json: weight_map puts {key} in {index['weight_map'][key]}"):
        _checkpoint_dtype(dense_copy)

def test_mxfp4_missing_scale(ckpts, tmp_path):
    path = tmp_path / "mx"
    shutil.copytree(ckpts["k3-tiny", "mxfp4"][0], path)
    key = "language_model.model.layers.4.block_sparse_moe.experts.5.w2.weight_scale"
    _rewrite(path, lambda ts: ts.pop(key, None))
    msg = _error(path)
    assert key in msg


def test_refuses_existing_directory(tmp_path):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match="exists"):
        save_random_checkpoint("k3-tiny", target, seed=0)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, no temp directory left behind
    assert (target / "keep.txt").read_text() == "precious"


def test_checkpoint_files_are_readable_by_safetensors(ckpts):
    path = ckpts["k3-tiny", "dense"][0]
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as s:
            assert s.metadata() == {"format": "pt"}
