"""Incremental inference: chunked prefill == one prefill; prefill + decode == one full forward (every position).

The reference is the one-shot forward over the whole 64-token prompt: a different code path from the chunked
ones (the KDA op takes its chunked branch over 64 tokens but its step branch in decode, the conv reads its cached
window, MLA / DSA attend to cached latents and index keys, and with top-k 16 the DSA rows of a 64-token prompt
are sparse).
"""

from __future__ import annotations

import pytest
import torch

from models.config import TINY_PRESETS
from modeltest_util import record, rel_err

TOL = 1e-4  # max relative error: max|a - b| / max|b| over all logits
PROMPT = 64


def _tokens(vocab: int, batch: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))


def _run_chunks(model, tokens, sizes):
    cache, outs, t = model.new_cache(tokens.shape[0]), [], 0
    for n in sizes:
        logits, cache = model(tokens[:, t:t + n], cache)
        outs.append(logits)
        t += n
    assert t == tokens.shape[1]
    return torch.cat(outs, 1), cache


def _chunks(size: int) -> list[int]:
    return [size] * (PROMPT // size) + ([PROMPT % size] if PROMPT % size else [])


@pytest.fixture(scope="module")
def full_forward():
    from modeltest_util import tiny

    out = {}
    for name in TINY_PRESETS:
        for batch in (1, 3):
            model = tiny(name)
            tokens = _tokens(model.config.vocab_size, batch)
            with torch.no_grad():
                out[name, batch] = (tokens, *model(tokens))
    return out


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_equals_single_prefill(tiny_model, full_forward, name, batch, chunk):
    model = tiny_model(name)
    tokens, want, want_cache = full_forward[name, batch]
    with torch.no_grad():
        got, cache = _run_chunks(model, tokens, _chunks(chunk))
    err = record(f"chunked prefill (chunk {chunk}) vs one prefill: logits rel", rel_err(got, want))
    assert err <= TOL, f"{name} batch {batch} chunk {chunk}: relative error {err:.2e}"
    # the caches agree too (state after 64 tokens), and the token counter
    assert set(cache) == set(want_cache)
    assert int(cache["pos"]) == PROMPT
    for key in want_cache:
        if key != "pos":
            assert cache[key].shape == want_cache[key].shape, key
            assert record("chunked prefill vs one prefill: cache rel", rel_err(cache[key], want_cache[key])) <= TOL, key


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_prefill_then_decode_equals_full_forward(tiny_model, full_forward, name, batch):
    model = tiny_model(name)
    tokens, want, _ = full_forward[name, batch]
    with torch.no_grad():  # prefill 37 tokens (crosses DSA top-k 16 and KDA chunk 16), then decode 27 one at a time
        got, _ = _run_chunks(model, tokens, [37] + [1] * (PROMPT - 37))
    err = record("prefill + decode vs full forward: logits rel", rel_err(got, want))
    assert err <= TOL, f"{name} batch {batch}: relative error {err:.2e}"


def test_batch_rows_are_independent(tiny_model):
    """Row 1 of a batch of 3 equals the same sequence run alone (no cross-row leakage in caches or MoE)."""
    model = tiny_model("k3.1-pro-tiny")
    tokens = _tokens(model.config.vocab_size, 3)
    with torch.no_grad():
        batched, _ = model(tokens)
        alone, _ = model(tokens[1:2])
    assert record("batch row vs same row alone: logits rel", rel_err(batched[1:2], alone)) <= TOL


def test_comparison_detects_a_stale_cache(tiny_model):
    """The test above can fail: decoding from a cache that lost one KDA state differs from the full forward."""
    model = tiny_model("k3-tiny")
    tokens = _tokens(model.config.vocab_size, 1)
    with torch.no_grad():
        want, _ = model(tokens[:, :40])
        _, cache = model(tokens[:, :39])
        cache = dict(cache)
        key = next(k for k in cache if k.endswith("kda_state"))
        cache[key] = torch.zeros_like(cache[key])
        got, _ = model(tokens[:, 39:40], cache)
    assert rel_err(got[:, 0], want[:, 39]) > TOL
