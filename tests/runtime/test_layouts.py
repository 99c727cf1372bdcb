"""Load-time weight layouts (k3c.runtime.layouts): the rules the runtime checks in schedule.json, the re-laying of
a weight, and an artifact whose MXFP4 experts the kernels read in `mxfp4_tiles_bits` end to end against
models/k3.py."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import k3c  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from k3c.errors import ArtifactError  # noqa: E402
from k3c.runtime.layouts import apply, declared, mx_tile_bits, mx_tile_words  # noqa: E402
from models.config import _TINY_COMMON, K3Config, _shrink  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402


def _schedule(*launches):
    return {"decode": {"launches": [{"name": f"k{i}", "inputs": ins, **({"weight_layouts": lay} if lay else {})}
                                    for i, (ins, lay) in enumerate(launches)]}}


@pytest.mark.parametrize("layout,relay", [("mxfp4_tiles", mx_tile_words), ("mxfp4_tiles_bits", mx_tile_bits)])
def test_apply_relays_each_weight_once_and_leaves_the_file_tensor(layout, relay):
    """Two launches (decode and prefill) asking the same layout of one weight: it is re-laid once, to
    `mx_tile_words` (`mx_tile_bits`) of it; on the CPU into a copy, so the tensor that maps the artifact's file
    keeps its bytes; weights no launch names keep theirs."""
    w = torch.randint(0, 256, (2, 64, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    other = torch.arange(6.0)
    weights = {"w": w, "b": other}
    sched = _schedule((["x", "w"], {"w": layout}))
    sched["prefill"] = _schedule((["y", "w", "b"], {"w": layout}))["decode"]
    src = w.clone()
    todo = declared(sched, weights, "art/weights")
    assert todo == {"w": layout}
    apply(weights, todo)
    assert torch.equal(weights["w"], relay(src)) and not torch.equal(weights["w"], src)
    assert torch.equal(w, src) and weights["b"] is other


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("layout,relay", [("mxfp4_tiles", mx_tile_words), ("mxfp4_tiles_bits", mx_tile_bits)])
def test_apply_relays_a_gpu_weight_in_place_chunk_by_chunk(monkeypatch, layout, relay):
    """On a GPU the weight is re-laid in place (the runtime's own copy), a chunk of experts at a time: the same
    storage afterwards, equal to the layout's re-laying of the whole, with chunks that split the experts
    unevenly."""
    import k3c.runtime.layouts as layouts

    monkeypatch.setattr(layouts, "CHUNK_BYTES", 3 * 64 * 256)      # 3 experts a chunk of 7
    w = torch.randint(0, 256, (7, 64, 256), dtype=torch.uint8, device="cuda")
    src, ptr = w.clone(), w.data_ptr()
    weights = {"w": w}
    apply(weights, {"w": layout})
    assert weights["w"].data_ptr() == ptr and torch.equal(weights["w"], relay(src))


@pytest.mark.parametrize("launches,match", [
    ([(["w"], {"w": "bf16_tiles"})], r"launch k0 reads weight w in layout 'bf16_tiles', which this runtime does not"),
    ([(["x"], {"x2": "mxfp4_tiles"})], r"launch k0 gives a layout to x2, which is not a weight"),
    ([(["w"], {"w": "mxfp4_tiles"}), (["w"], None)], r"launch k1 reads weight w in the checkpoint's order"),
])
def test_inconsistent_layouts_are_artifact_errors(launches, match):
    """An unknown layout, a layout of something that is not a weight, and a weight read re-laid by one launch and
    in the checkpoint's order by another: one ArtifactError naming the artifact, the launch and the weight."""
    weights = {"w": torch.zeros(1, 32, 128, dtype=torch.uint8), "x": torch.zeros(1)}
    with pytest.raises(ArtifactError, match="^art/w.st: schedule.json " + match):
        declared(_schedule(*launches), weights, "art/w.st")


def test_two_layouts_of_one_weight_a_malformed_entry_and_a_bad_shape_are_artifact_errors(monkeypatch):
    """Two layouts asked of one weight, a `weight_layouts` that is not a mapping, and a weight whose shape its
    layout cannot take (checked before any copy): one ArtifactError each."""
    import k3c.runtime.layouts as layouts

    monkeypatch.setitem(layouts.LAYOUTS, "other", layouts.LAYOUTS["mxfp4_tiles"])
    weights = {"w": torch.zeros(1, 32, 128, dtype=torch.uint8)}
    with pytest.raises(ArtifactError, match=r"asks weight w in layouts 'mxfp4_tiles' and 'other' \(launch k1\)"):
        declared(_schedule((["w"], {"w": "mxfp4_tiles"}), (["w"], {"w": "other"})), weights, "art/w.st")
    with pytest.raises(ArtifactError, match=r"launch k0: weight_layouts must map weight names to layout names"):
        declared(_schedule((["w"], ["w", "mxfp4_tiles"])), weights, "art/w.st")
    weights = {"w": torch.zeros(1, 48, 128, dtype=torch.uint8)}
    with pytest.raises(ArtifactError, match=r"art/w.st: weight w cannot take layout 'mxfp4_tiles': torch.uint8 "
                                            r"\[1, 48, 128\]: expected u8 \[E, R, K/2\] with R a multiple of 32"):
        declared(_schedule((["w"], {"w": "mxfp4_tiles"})), weights, "art/w.st")


def _config() -> K3Config:
    """K3's structure at the smallest width whose routed experts are whole `mxfp4_tiles` of two K tiles a row
    (latent and inner width 512; at 256 the layout is the row-major order itself): a KDA layer with a dense MLP,
    then an MLA layer with the LatentMoE."""
    over = dict(_TINY_COMMON, num_hidden_layers=2, vocab_size=64, q_lora_rank=32, routed_expert_hidden_size=512,
                moe_intermediate_size=512, attn_res_block_size=2, num_shared_experts=1)
    return _shrink("mxfp4-tiles-tiny", "k3", linear_attn_config=dict(kda_layers=[1], full_attn_layers=[2],
                                                                     num_heads=2, head_dim=16), **over)


@pytest.mark.slow
def test_tiled_experts_end_to_end(tmp_path):
    """An MXFP4 checkpoint whose experts tile: the artifact stores the checkpoint's bytes, schedule.json asks
    `mxfp4_tiles_bits` of the three packed matrices for every moe_experts launch, the session holds them re-laid
    (the tiles of the file's bytes, each word's bits placed), and the compiled model (its kernels addressing the
    tiles and decoding the placed bits) matches models/k3.py eager on a 6-token prefill and two decode steps
    (≤ 1e-4 of the largest logit)."""
    model = save_random_checkpoint(_config(), tmp_path / "ckpt", seed=5, dtype=torch.float32,
                                   expert_format="mxfp4").eval()
    opts = CompileOptions(str(tmp_path / "ckpt"), tmp_path / "art", target="cpu-x86-64", max_batch=1, max_seq=8,
                          max_prefill=6, dtype="f32", backend="triton")
    compile_model(opts)
    s = k3c.load(opts.out, "cpu")
    moe = [ln for e in s.schedule.values() for ln in e["launches"] if ln["kind"] == "moe_experts"]
    packed = sorted(k for k in load_file(str(opts.out / "weights/params.safetensors")) if k.endswith("weight_packed"))
    assert len(packed) == 3 and len(moe) == 2
    assert all(ln["weight_layouts"] == dict.fromkeys(packed, "mxfp4_tiles_bits") for ln in moe)
    assert s.weight_layouts == dict.fromkeys(packed, "mxfp4_tiles_bits")
    stored = load_file(str(opts.out / "weights/params.safetensors"))
    for k in packed:
        assert torch.equal(s.weights[k], mx_tile_bits(stored[k])) and not torch.equal(s.weights[k], stored[k])
    tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, cache = model(tokens)
    got = s.prefill(tokens)
    assert float((got - want[:, -1:]).abs().max() / want.abs().max()) <= 1e-4
    nxt = want[:, -1:].argmax(-1)
    for _ in range(2):
        with torch.no_grad():
            want, cache = model(nxt, cache)
        got = s.decode(nxt)
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
        nxt = want[:, -1:].argmax(-1)
