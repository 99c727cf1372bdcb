"""Helpers for tests/model/: cached tiny models and the error measures the suite reports."""

from __future__ import annotations

import functools

import torch

from models.config import K3Config
from models.k3 import K3ForCausalLM


@functools.lru_cache(maxsize=None)
def tiny(name: str, seed: int = 0) -> K3ForCausalLM:
    """A randomly initialised fp32 tiny preset, built once per session (callers must not mutate it)."""
    model = K3ForCausalLM(K3Config.from_pretrained(name)).init_random_(seed)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (the suite's "max relative error")."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


# Largest errors seen, by test name; printed at the end of the session (`pytest -s`) for the report.
MEASURED: dict[str, float] = {}


def record(name: str, value: float) -> float:
    MEASURED[name] = max(MEASURED.get(name, 0.0), value)
    return value
