"""Compile a random checkpoint of each tiny preset with the Triton backend, run the artifact on CPU (Triton kernels
interpreted), and compare the logits with `models/k3.py` eager: a 64-token prefill (the last position's logits;
every position's through `prefill_all` for the first preset), then 32 decode steps, batch 1 and 3."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from models.config import TINY_PRESETS, K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402

PROMPT, STEPS = 64, 32


@pytest.fixture(scope="module", params=TINY_PRESETS)
def compiled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = save_random_checkpoint(K3Config.from_pretrained(request.param), root / "ckpt", seed=1,
                                   dtype=torch.float32)
    opts = CompileOptions(str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=3, max_seq=PROMPT + STEPS,
                          max_prefill=PROMPT, dtype="f32", backend="triton",
                          all_logits=request.param == TINY_PRESETS[0])
    compile_model(opts)
    return model.eval(), k3c.load(opts.out, "cpu")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_then_decode_matches_eager(compiled, batch):
    model, session = compiled
    session.reset()
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=gen)
    with torch.no_grad():
        want, cache = model(tokens)
    got = session.prefill(tokens)
    assert got.shape == (batch, 1, model.config.vocab_size)
    assert _rel(got, want[:, -1:]) <= 1e-4
    if "prefill_all" in session.schedule:
        session.reset()
        got = session.prefill(tokens, logits="all")
        assert got.shape == (batch, PROMPT, model.config.vocab_size)
        assert _rel(got, want) <= 1e-4
    nxt = want[:, -1:].argmax(-1)
    for _ in range(STEPS):
        with torch.no_grad():
            want, cache = model(nxt, cache)
        got = session.decode(nxt)
        assert _rel(got, want) <= 1e-4
        nxt = want[:, -1:].argmax(-1)
