"""Compiled artifacts shared by the runtime tests: each (preset, backend) once per session, and each preset's
native TVM artifacts (shared by the TVM end-to-end and the tensor-parallel tests); the sizes and the reasons for
them are in runtime_sizes.py."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton kernels in the interpreter; a GPU machine compiles them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from k3c.compile import CompileOptions, compile_model  # noqa: E402
from models.config import TINY_PRESETS, K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402
from runtime_sizes import MAX_BATCH, MAX_PREFILL, MAX_SEQ, MXFP4_PRESET, TVM_PROMPT, TVM_STEPS  # noqa: E402


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """compiled(preset, backend="triton") -> (checkpoint dir, artifact dir, fp32 reference model): `preset`
    compiled f32 for the CPU target with `backend` at MAX_BATCH / MAX_SEQ / MAX_PREFILL, once per session and
    shared by every test that asks (copy the artifact before changing it)."""
    cache: dict = {}

    def get(preset: str, backend: str = "triton"):
        if (preset, backend) not in cache:
            root = tmp_path_factory.mktemp(f"{preset}-{backend}")
            model = save_random_checkpoint(K3Config.from_pretrained(preset), root / "ckpt", seed=1,
                                           dtype=torch.float32,
                                           expert_format="mxfp4" if preset == MXFP4_PRESET else "dense")
            opts = CompileOptions(str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=MAX_BATCH,
                                  max_seq=MAX_SEQ, max_prefill=MAX_PREFILL, dtype="f32", backend=backend,
                                  all_logits=preset == TINY_PRESETS[0])
            compile_model(opts)
            cache[preset, backend] = root / "ckpt", opts.out, model.eval()
        return cache[preset, backend]

    return get


@pytest.fixture(scope="session")
def tvm_compiled(tmp_path_factory):
    """tvm_compiled(preset) -> (eager fp32 model, checkpoint dir, arts(dtype) -> artifact dir): the preset's seed-1
    f32 checkpoint (MXFP4 routed experts for MXFP4_PRESET, like the published ones) and its artifacts for
    `cpu-x86-64` with the TVM backend at max_batch 3, max_seq TVM_PROMPT + TVM_STEPS, max_prefill TVM_PROMPT in
    `dtype` ("f32" | "bf16"), each compiled on first use, once per session."""
    cache: dict = {}

    def get(preset: str):
        if preset not in cache:
            root = tmp_path_factory.mktemp(f"{preset}-tvm")
            model = save_random_checkpoint(K3Config.from_pretrained(preset), root / "ckpt", seed=1,
                                           dtype=torch.float32,
                                           expert_format="mxfp4" if preset == MXFP4_PRESET else "dense")
            done = {}

            def arts(dtype):
                if dtype not in done:
                    opts = CompileOptions(str(root / "ckpt"), root / f"art_{dtype}", target="cpu-x86-64",
                                          max_batch=3, max_seq=TVM_PROMPT + TVM_STEPS, max_prefill=TVM_PROMPT,
                                          dtype=dtype, backend="tvm")
                    compile_model(opts)
                    done[dtype] = opts.out
                return done[dtype]

            cache[preset] = model.eval(), root / "ckpt", arts
        return cache[preset]

    return get
