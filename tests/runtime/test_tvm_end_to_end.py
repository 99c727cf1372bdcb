"""The CPU deployment path: each tiny preset compiled for `cpu-x86-64` (TVM kernels in one `kernels/cpu.so`), run
natively by `k3c.load(..., "cpu")`, against `models/k3.py` eager over a 64-token prefill and 32 decode steps at
batch 1 and 3. k3.1-pro-tiny's checkpoint stores MXFP4 routed experts (like the published K3 checkpoints): its
artifact keeps them 4-bit and the CPU kernel decodes them in its dot loops.

f32 artifact vs eager fp32: max relative ≤ 1e-4 on every step's logits (all presets). bf16 artifact vs eager fp32
(k3.1-pro-tiny, batch 3): within 1.5× the distance of eager bf16 from eager fp32 on the same checkpoint and tokens
(the band bf16 rounding opens), plus 1e-2; both distances are printed (this random model amplifies rounding: both
are near 1). The runtime that ran an artifact imports `tvm_ffi` but neither `tvm`, Triton nor the compiler.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import k3c
from models.checkpoint import load_checkpoint
from models.config import TINY_PRESETS
from runtime_sizes import TVM_PROMPT, TVM_STEPS

PROMPT, STEPS = TVM_PROMPT, TVM_STEPS
pytestmark = pytest.mark.slow  # compiles artifacts (TVM) and runs them end to end: `make test`, not `make test-quick`


@pytest.fixture(scope="module", params=TINY_PRESETS)
def compiled(request, tvm_compiled):
    """(eager fp32 model, checkpoint dir, arts(dtype) -> artifact dir, compiled on first use) of one preset
    (conftest.py: shared with the tensor-parallel test)."""
    return tvm_compiled(request.param)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _errors(run, model, batch):
    """Max relative error of `run(tokens, cache)` -> (logits, cache) against eager fp32 on every step, along eager
    fp32's greedy tokens."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    errs, cache, other = [], None, None
    with torch.no_grad():
        for _ in range(STEPS + 1):
            want, cache = model(tokens, cache) if cache is not None else model(tokens)
            got, other = run(tokens, other)
            errs.append(_rel(got, want[:, -got.shape[1]:]))  # prefill returns the last position's logits
            tokens = want[:, -1:].argmax(-1)
    return errs


def _session_run(session):
    session.reset()
    return lambda t, _: (session.prefill(t) if t.shape[1] > 1 else session.decode(t), None)


@pytest.mark.parametrize("batch", [1, 3])
def test_f32_artifact_matches_eager(compiled, batch):
    model, _, arts = compiled
    session = k3c.load(arts("f32"), "cpu")
    assert set(session.launchers) == {"tvm", "library", "view"}
    errs = _errors(_session_run(session), model, batch)
    print(f"{model.config.name} batch {batch}: f32 artifact vs eager fp32, max relative {max(errs):.2e}")
    assert max(errs) <= 1e-4


@pytest.mark.parametrize("compiled", ["k3.1-pro-tiny"], indirect=True)  # one preset: CI time
def test_bf16_artifact_in_the_eager_bf16_band(compiled):
    model, ckpt, arts = compiled
    m16 = load_checkpoint(str(ckpt), torch.bfloat16).eval()
    band = _errors(lambda t, c: m16(t, c) if c is not None else m16(t), model, 3)
    errs = _errors(_session_run(k3c.load(arts("bf16"), "cpu")), model, 3)
    print(f"{model.config.name}: bf16 artifact vs eager fp32 {max(errs):.3g}; eager bf16 vs eager fp32 "
          f"{max(band):.3g}")
    assert max(errs) <= 1.5 * max(band) + 1e-2


@pytest.mark.parametrize("compiled", ["k3.1-pro-tiny"], indirect=True)
def test_runtime_loads_the_library_with_tvm_ffi_only(compiled):
    """A fresh process runs the artifact: tvm_ffi is imported, tvm, Triton and the compiler are not."""
    _, _, arts = compiled
    code = (f"import sys, torch, k3c\ns = k3c.load({str(arts('f32'))!r}, 'cpu')\n"
            "s.prefill(torch.zeros(1, 4, dtype=torch.long)); s.decode(torch.zeros(1, 1, dtype=torch.long))\n"
            "mods = set(sys.modules)\n"
            "bad = sorted(m for m in mods if m == 'tvm' or m.startswith(('tvm.', 'triton', 'k3c.ir', 'k3c.passes', "
            "'k3c.frontend', 'k3c.codegen', 'k3c.compile', 'models')))\n"
            "print('tvm_ffi' in mods, ','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["True"], r.stdout
