"""The CPU deployment path: each tiny preset compiled for `cpu-x86-64` (TVM kernels in one `kernels/cpu.so`), run
natively by `k3c.load(..., "cpu")`, against `models/k3.py` eager over a 64-token prefill and 32 decode steps at
batch 1 and 3.

f32 artifact vs eager fp32: max relative ≤ 1e-4 on every step's logits. bf16 artifact vs eager fp32: within twice
the distance of eager bf16 from eager fp32 on the same checkpoint (the band bf16 rounding itself opens; both
distances are printed), plus 1e-2 for steps where eager bf16 happens to land very close.
"""

from __future__ import annotations

import pytest
import torch

import k3c
from k3c.compile import CompileOptions, compile_model
from models.config import TINY_PRESETS, K3Config
from models.k3 import save_random_checkpoint

PROMPT, STEPS = 64, 32


@pytest.fixture(scope="module", params=TINY_PRESETS)
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = save_random_checkpoint(K3Config.from_pretrained(request.param), root / "ckpt", seed=1,
                                   dtype=torch.float32)
    return root, model.eval()


def _compile(root, dtype):
    opts = CompileOptions(str(root / "ckpt"), root / f"art_{dtype}", target="cpu-x86-64", max_batch=3,
                          max_seq=PROMPT + STEPS, max_prefill=PROMPT, dtype=dtype, backend="tvm")
    compile_model(opts)
    return k3c.load(opts.out, "cpu")


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _trajectory(step, model, batch):
    """Per-step logits of `step(tokens)` ([B,T] -> [B,1,V]: the last position's) along the eager fp32 model's greedy
    tokens, with the eager model's logits of the same positions."""
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=gen)
    with torch.no_grad():
        want, cache = model(tokens)
        outs, wants = [step(tokens)], [want[:, -1:]]
        nxt = want[:, -1:].argmax(-1)
        for _ in range(STEPS):
            want, cache = model(nxt, cache)
            outs.append(step(nxt))
            wants.append(want)
            nxt = want[:, -1:].argmax(-1)
    return outs, wants


@pytest.mark.parametrize("batch", [1, 3])
def test_f32_artifact_matches_eager(checkpoint, batch):
    root, model = checkpoint
    session = _compile(root, "f32")
    assert session.backend == "tvm"
    session.reset()
    got, want = _trajectory(lambda t: session.prefill(t) if t.shape[1] > 1 else session.decode(t), model, batch)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    print(f"{model.config.name} batch {batch}: f32 artifact vs eager fp32 max relative {max(errs):.2e}")
    assert max(errs) <= 1e-4


def test_bf16_artifact_in_the_eager_bf16_band(checkpoint):
    root, model = checkpoint
    session = _compile(root, "bf16")
    session.reset()
    got, want = _trajectory(lambda t: session.prefill(t) if t.shape[1] > 1 else session.decode(t), model, 3)
    eager16 = K3Config.from_pretrained(model.config.name)
    from models.checkpoint import load_checkpoint
    m16 = load_checkpoint(str(root / "ckpt"), torch.bfloat16).eval()
    cache16 = None
    band = []
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (3, PROMPT), generator=gen)
    with torch.no_grad():
        for i, w in enumerate(want):
            x, cache16 = m16(tokens, cache16) if cache16 is not None else m16(tokens)
            band.append(_rel(x[:, -1:], w))
            tokens = w[:, -1:].argmax(-1)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    print(f"{model.config.name}: bf16 artifact vs eager fp32 max relative {max(errs):.3g}; "
          f"eager bf16 vs eager fp32 {max(band):.3g}")
    assert max(errs) <= 2 * max(band) + 1e-2
    assert eager16 is not None
