"""Compile a random checkpoint of each tiny preset with each CPU backend, run the artifact on CPU (Triton kernels
interpreted), and compare the logits with `models/k3.py` eager: a prompt prefilled in two calls (a full and a
partial KDA chunk, then the token-loop form; the last position's logits, and for the first preset every position's
of the first call through `prefill_all`), then decode steps, batch 1 and 2 (sizes and why: runtime_sizes.py).
Every launch with planned scratch runs on the arena's buffers and allocates none of its own (scratch_guard.py).

k3.1-pro-tiny's checkpoint stores its routed experts as MXFP4, like the published K3 checkpoints (conftest.py,
MXFP4_PRESET): its artifact keeps them 4-bit (the checkpoint's bytes) and its kernels dequantize them in registers,
against the eager model loaded from the same checkpoint (dequantized); the other two presets cover dense experts."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.codegen.triton.kda import CHUNK  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from models.config import TINY_PRESETS  # noqa: E402
from runtime_sizes import BACKENDS, MAX_PREFILL, MXFP4_PRESET, PROMPT, STEPS  # noqa: E402
from scratch_guard import guard_scratch  # noqa: E402

pytestmark = pytest.mark.slow  # compiles artifacts and interprets them: `make test`, not `make test-quick`


#: (preset, backend, batch): batch 1 on the other presets, batch 2 on the MXFP4 preset (DSA, MLA, KDA and MXFP4
#: experts: every model kernel, and rows that differ), since interpreting costs minutes per case and grows with the
#: batch (the suite keeps to 20 minutes); test_tvm_end_to_end.py runs every preset at batch 1 and 3 natively.
CASES = [(p, b, 2 if p == MXFP4_PRESET else 1) for p in TINY_PRESETS for b in BACKENDS]


@pytest.fixture(scope="module")
def sessions(compiled):
    """(preset, backend) -> (eager fp32 model, loaded session), loaded once per module."""
    cache: dict = {}

    def get(preset, backend):
        if (preset, backend) not in cache:
            _, art, model = compiled(preset, backend)
            cache[preset, backend] = model, k3c.load(art, "cpu")
        return cache[preset, backend]

    return get


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("preset,backend,batch", CASES, ids=[f"{p}-{b}-{n}" for p, b, n in CASES])
def test_prefill_then_decode_matches_eager(sessions, preset, backend, batch, monkeypatch):
    """With a `prefill_all` entry (the first preset), the first call goes through it (every position's logits) and
    the second through `prefill` on the same cache: their kernels differ only in the head (the layer kernels of both
    entries are the same generated text), so each form of each layer kernel runs once, and the prompt is
    interpreted once rather than once per entry."""
    model, s = sessions(preset, backend)
    cfg = model.config
    # the sizes cross every boundary runtime_sizes.py names: a full and a partial KDA chunk in the first call, the
    # token loop (2..CHUNK-1 tokens) in the second, keys past DSA's top-k and past the f32 key block of 32
    assert CHUNK < MAX_PREFILL < 2 * CHUNK and 1 < PROMPT - MAX_PREFILL < CHUNK
    assert PROMPT + STEPS > max(32, cfg.index_topk)
    # and MoE row counts (tokens x top-k) that are not powers of two in both prefill calls, so the expert schedule
    # kernel's power-of-two row block has a masked tail (k3c/codegen/triton/moe.py moe_schedule; decode's batch x
    # top-k rows fill it at batch 1 and 2)
    k = cfg.num_experts_per_token
    assert all(n & (n - 1) for n in (batch * MAX_PREFILL * k, batch * (PROMPT - MAX_PREFILL) * k))
    s.reset()
    handed = guard_scratch(s, monkeypatch)
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, cfg.vocab_size, (batch, PROMPT), generator=gen)
    assert all(not torch.equal(tokens[0], row) for row in tokens[1:])  # rows that differ
    with torch.no_grad():
        want, cache = model(tokens)
    first = "prefill_all" if "prefill_all" in s.schedule else "prefill"
    if first == "prefill_all":
        got = s.prefill(tokens[:, :MAX_PREFILL], logits="all")
        assert got.shape == (batch, MAX_PREFILL, cfg.vocab_size)
        assert _rel(got, want[:, :MAX_PREFILL]) <= 1e-4
        got = s.prefill(tokens[:, MAX_PREFILL:])
    else:
        got = s.prefill(tokens)  # calls of MAX_PREFILL and PROMPT - MAX_PREFILL tokens; the last position's logits
    assert s.length == PROMPT
    assert got.shape == (batch, 1, cfg.vocab_size)
    assert _rel(got, want[:, -1:]) <= 1e-4
    # the MAX_PREFILL-token call runs every scratch path (KDA's chunked prefill, the MoE GEMMs, the DSA indexer's sort
    # keys) but attention's split-K, which needs more than MIN_KEYS_PER_SPLIT = 64 keys
    # (tests/kernels/test_triton_scratch.py)
    assert set(handed) == {ln["kind"] for ln in s.schedule[first]["launches"] if "scratch" in ln} - {"mla_attention"}
    nxt = want[:, -1:].argmax(-1)
    for _ in range(STEPS):
        with torch.no_grad():
            want, cache = model(nxt, cache)
        got = s.decode(nxt)
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


def test_mxfp4_artifact_keeps_the_checkpoint_bytes(compiled, tmp_path):
    """The artifact's routed experts are the checkpoint's packed bytes and scales (no dense copy), the compiler
    recorded their largest scale byte on the moe_experts nodes and in the kernel modules, and plan.json counts them; `--experts-dtype bf16` of the same checkpoint stores them dequantized, at f32 32/4.25 = 7.5x the
    bytes, as the stacked dense parameters of the eager model."""
    import json

    from safetensors.torch import load_file

    from k3c.ir import serialize

    ckpt, out, model = compiled(MXFP4_PRESET)
    want = _checkpoint_experts(ckpt)
    art = load_file(str(out / "weights/params.safetensors"))
    assert want and {k for k in art if ".experts.w" in k} == set(want)
    for k, t in want.items():
        assert art[k].dtype == torch.uint8 and torch.equal(art[k], t), k
    expert_bytes = sum(t.numel() for t in want.values())
    top = max(int(t.max()) for k, t in want.items() if k.endswith("weight_scale"))   # the scale fact the compiler read
    for entry in ("decode", "prefill"):
        g = serialize.loads((out / f"graph/{entry}.json").read_text())
        assert {n.attrs["scale_max"] for n in g.nodes if n.op == "moe_experts"} == {top}
    assert any(f"\nSCALE_MAX = {top}  #" in p.read_text() for p in (out / "kernels").rglob("*.py"))
    plan = json.loads((out / "plan.json").read_text())
    assert plan["weights"]["experts"] == expert_bytes
    dense = CompileOptions(str(ckpt), tmp_path / "bf16", target="cpu-x86-64", max_batch=1, max_seq=8, max_prefill=8,
                           dtype="f32", experts_dtype="bf16", backend="triton")
    s = compile_model(dense)
    weights = load_file(str(dense.out / "weights/params.safetensors"))
    stacked = {k: v for k, v in weights.items() if ".experts.w" in k}
    assert all(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in stacked)
    assert s["weights"]["experts"] == sum(v.numel() * 4 for v in stacked.values())
    assert s["weights"]["experts"] * 17 == expert_bytes * 128        # 4 bytes vs 1/2 + 1/32 byte per weight
    assert json.loads((dense.out / "manifest.json").read_text())["extra"]["experts_dtype"] == "bf16"
    w2 = "model.layers.1.block_sparse_moe.experts.w2"
    assert torch.equal(stacked[w2], model.get_parameter(w2).detach())
