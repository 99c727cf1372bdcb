"""Compile a random checkpoint of each tiny preset with the Triton backend, run the artifact on CPU (Triton kernels
interpreted), and compare every logit with `models/k3.py` eager: a 64-token prefill, then 32 decode steps, batch 1
and 3.

k3.1-pro-tiny's checkpoint stores its routed experts as MXFP4, like the published K3 checkpoints: its artifact
keeps them 4-bit (the checkpoint's bytes) and its kernels dequantize them in registers, against the eager model
loaded from the same checkpoint (dequantized); the other two presets cover dense experts."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from models.config import TINY_PRESETS, K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402

PROMPT, STEPS = 64, 32
MXFP4_PRESET = "k3.1-pro-tiny"


@pytest.fixture(scope="module", params=TINY_PRESETS)
def compiled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    fmt = "mxfp4" if request.param == MXFP4_PRESET else "dense"
    model = save_random_checkpoint(K3Config.from_pretrained(request.param), root / "ckpt", seed=1,
                                   dtype=torch.float32, expert_format=fmt)
    opts = CompileOptions(str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=3, max_seq=PROMPT + STEPS,
                          max_prefill=PROMPT, dtype="f32", backend="triton")
    compile_model(opts)
    return model.eval(), k3c.load(opts.out, "cpu"), opts


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_then_decode_matches_eager(compiled, batch):
    model, session, _ = compiled
    session.reset()
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=gen)
    with torch.no_grad():
        want, cache = model(tokens)
    got = session.prefill(tokens)
    assert got.shape == (batch, PROMPT, model.config.vocab_size)
    assert _rel(got, want) <= 1e-4
    nxt = want[:, -1:].argmax(-1)
    for _ in range(STEPS):
        with torch.no_grad():
            want, cache = model(nxt, cache)
        got = session.decode(nxt)
        assert _rel(got, want) <= 1e-4
        nxt = want[:, -1:].argmax(-1)


def _checkpoint_experts(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's MXFP4 expert tensors, read with safetensors directly, stacked here over experts."""
    import re

    from safetensors.torch import load_file

    per: dict[str, dict[int, torch.Tensor]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for k, t in load_file(str(f)).items():
            m = re.match(r"^language_model\.(.*\.experts)\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$", k)
            if m:
                per.setdefault(f"{m[1]}.{m[3]}.{m[4]}", {})[int(m[2])] = t
    return {k: torch.stack([v[e] for e in sorted(v)]) for k, v in per.items()}


@pytest.mark.parametrize("compiled", [MXFP4_PRESET], indirect=True)
def test_mxfp4_artifact_keeps_the_checkpoint_bytes(compiled, tmp_path):
    """The artifact's routed experts are the checkpoint's packed bytes and scales (no dense copy), and plan.json
    counts them; `--experts-dtype bf16` of the same checkpoint stores them dequantized, at f32 32/4.25 = 7.5x the
    bytes, as the stacked dense parameters of the eager model."""
    import json

    from safetensors.torch import load_file

    _, _, opts = compiled
    ckpt = Path(opts.model)
    want = _checkpoint_experts(ckpt)
    art = load_file(str(opts.out / "weights/params.safetensors"))
    assert want and {k for k in art if ".experts.w" in k} == set(want)
    for k, t in want.items():
        assert art[k].dtype == torch.uint8 and torch.equal(art[k], t), k
    expert_bytes = sum(t.numel() for t in want.values())
    plan = json.loads((opts.out / "plan.json").read_text())
    assert plan["weights"]["experts"] == expert_bytes
    dense = CompileOptions(opts.model, tmp_path / "bf16", target="cpu-x86-64", max_batch=1, max_seq=8, max_prefill=8,
                           dtype="f32", experts_dtype="bf16", backend="triton")
    s = compile_model(dense)
    weights = load_file(str(dense.out / "weights/params.safetensors"))
    stacked = {k: v for k, v in weights.items() if ".experts.w" in k}
    assert all(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in stacked)
    assert s["weights"]["experts"] == sum(v.numel() * 4 for v in stacked.values())
    assert s["weights"]["experts"] * 17 == expert_bytes * 128        # 4 bytes vs 1/2 + 1/32 byte per weight
    assert json.loads((dense.out / "manifest.json").read_text())["extra"]["experts_dtype"] == "bf16"
    model = compiled[0]
    w2 = "model.layers.1.block_sparse_moe.experts.w2"
    assert torch.equal(stacked[w2], model.get_parameter(w2).detach())
