"""Shared fixture for the reference-model tests (tests/model/): cached tiny models."""

from __future__ import annotations

import pytest

from modeltest_util import tiny


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are dominated by per-op overhead: intra-op threads only add contention on a shared 2-core
    machine (10x slower decode under load). Restored after each module, so other suites are unaffected."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def tiny_model():
    """tiny_model(name, seed=0): a randomly initialised fp32 tiny preset, built once per session (do not mutate)."""
    return tiny


def pytest_terminal_summary(terminalreporter):
    from modeltest_util import MEASURED

    if MEASURED:
        terminalreporter.write_sep("-", "tests/model: largest measured errors")
        for name, value in sorted(MEASURED.items()):
            terminalreporter.write_line(f"{name:60s} {value:.3e}")
