"""Compile a random checkpoint of each tiny preset with each CPU backend, run the artifact on CPU (Triton kernels
interpreted), and compare every logit with `models/k3.py` eager: a prompt prefilled in two calls (a partial KDA
chunk, then the token-loop form), then decode steps, batch 1 and 3 (sizes and why: runtime_sizes.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from models.config import TINY_PRESETS  # noqa: E402
from runtime_sizes import BACKENDS, MAX_PREFILL, PROMPT, STEPS  # noqa: E402

pytestmark = pytest.mark.slow  # compiles artifacts and interprets them: `make test`, not `make test-quick`


@pytest.fixture(scope="module", params=[(p, b) for p in TINY_PRESETS for b in BACKENDS], ids="-".join)
def session(request, compiled):
    _, art, model = compiled(*request.param)
    return model, k3c.load(art, "cpu")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_then_decode_matches_eager(session, batch):
    model, s = session
    s.reset()
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=gen)
    with torch.no_grad():
        want, cache = model(tokens)
    got = s.prefill(tokens)  # calls of MAX_PREFILL and PROMPT - MAX_PREFILL tokens
    assert PROMPT > MAX_PREFILL and s.length == PROMPT
    assert got.shape == (batch, PROMPT, model.config.vocab_size)
    assert _rel(got, want) <= 1e-4
    nxt = want[:, -1:].argmax(-1)
    for _ in range(STEPS):
        with torch.no_grad():
            want, cache = model(nxt, cache)
        got = s.decode(nxt)
        assert _rel(got, want) <= 1e-4
        nxt = want[:, -1:].argmax(-1)
