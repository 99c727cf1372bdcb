"""Compiled artifacts shared by the runtime tests: each (preset, backend) once per session, each preset's native TVM
artifacts (shared by the TVM end-to-end and the tensor-parallel tests) and its TP = 2 / 4 ones; the sizes and the
reasons for them are in runtime_sizes.py.

Compiles run in two spawned compiler processes (`compile_pool`), and every artifact that the selected tests ask for
is submitted before the first runtime test runs (`_prefetch`): the test process interprets Triton kernels on one
core for minutes while CI's second core would idle, and a TVM build takes tens of seconds of one core, so the
builds overlap the interpreted tests instead of following them. The artifacts are the ones a compile in the test
process writes (`compile_model` with the same options; builds are deterministic). An artifact asked for before its
compile started is compiled in the test process instead (its queued job cancelled)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

import torch

if not torch.cuda.is_available():  # CPU: Triton kernels in the interpreter; a GPU machine compiles them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from k3c.compile import CompileOptions, compile_model  # noqa: E402
from models.config import TINY_PRESETS, K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402
from runtime_sizes import (MAX_BATCH, MAX_PREFILL, MAX_SEQ, MXFP4_PRESET, PROMPT, TP_STEPS, TP_WORLDS,  # noqa: E402
                           TVM_PROMPT, TVM_STEPS, tp_ep)


class _Builds:
    """Artifacts by key, each compiled once per session: in the pool when submitted ahead (`submit`), else (or when
    its job had not started) in this process (`get`). Seed-1 f32 checkpoints, one per (preset, root name)."""

    def __init__(self, pool: ProcessPoolExecutor, tmp_path_factory):
        self.pool, self.tmp = pool, tmp_path_factory
        self.roots: dict[str, tuple] = {}
        self.jobs: dict[tuple, tuple[CompileOptions, Future | None]] = {}
        self.done: dict[tuple, dict] = {}

    def checkpoint(self, preset: str, name: str):
        """(root dir, eager fp32 model) of `preset`'s checkpoint under root/ckpt, saved once per `name`; MXFP4 routed
        experts for MXFP4_PRESET (like the published checkpoints), dense for the others."""
        if name not in self.roots:
            root = self.tmp.mktemp(name)
            model = save_random_checkpoint(K3Config.from_pretrained(preset), root / "ckpt", seed=1,
                                           dtype=torch.float32,
                                           expert_format="mxfp4" if preset == MXFP4_PRESET else "dense")
            self.roots[name] = root, model.eval()
        return self.roots[name]

    def submit(self, key: tuple, options) -> None:
        """Queue `options()` (-> CompileOptions) in the pool under `key`, unless known already."""
        if key not in self.jobs:
            opts = options()
            self.jobs[key] = opts, self.pool.submit(compile_model, opts)

    def get(self, key: tuple, options) -> tuple:
        """(artifact dir, compile summary) of `key`, compiling `options()` here if nobody started it."""
        if key not in self.done:
            opts, job = self.jobs.get(key) or (options(), None)
            self.done[key] = job.result() if job is not None and not job.cancel() else compile_model(opts)
            self.jobs[key] = opts, None
        return self.jobs[key][0].out, self.done[key]


@pytest.fixture(scope="session")
def compile_pool():
    """Two spawned processes that run `compile_model` (the module docstring says why). At the end of the session
    queued jobs are dropped and the workers exit without the session waiting (a process that imported torch and
    tvm takes seconds to exit; Python joins them when it exits itself)."""
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def _builds(compile_pool, tmp_path_factory) -> _Builds:
    return _Builds(compile_pool, tmp_path_factory)


def _triton_options(builds: _Builds, preset: str, backend: str):
    root, _ = builds.checkpoint(preset, f"{preset}-{backend}")
    return lambda: CompileOptions(str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=MAX_BATCH,
                                  max_seq=MAX_SEQ, max_prefill=MAX_PREFILL, dtype="f32", backend=backend,
                                  all_logits=preset == TINY_PRESETS[0])


def _tvm_options(builds: _Builds, preset: str, dtype: str):
    root, _ = builds.checkpoint(preset, f"{preset}-tvm")
    return lambda: CompileOptions(str(root / "ckpt"), root / f"art_{dtype}", target="cpu-x86-64", max_batch=3,
                                  max_seq=TVM_PROMPT + TVM_STEPS, max_prefill=TVM_PROMPT, dtype=dtype, backend="tvm")


def _tp_options(builds: _Builds, preset: str, tp: int):
    root, _ = builds.checkpoint(preset, f"{preset}-tvm")
    return lambda: CompileOptions(str(root / "ckpt"), root / f"tp{tp}", target="cpu-x86-64", tp=tp,
                                  ep=tp_ep(preset, tp), max_batch=3, max_seq=PROMPT + TP_STEPS,
                                  max_prefill=MAX_PREFILL, dtype="f32", backend="tvm")


@pytest.fixture(scope="session")
def compiled(_builds):
    """compiled(preset, backend="triton") -> (checkpoint dir, artifact dir, fp32 reference model): `preset`
    compiled f32 for the CPU target with `backend` at MAX_BATCH / MAX_SEQ / MAX_PREFILL (and `prefill_all` for the
    first preset), once per session and shared by every test that asks (copy the artifact before changing it)."""

    def get(preset: str, backend: str = "triton"):
        out, _ = _builds.get(("triton", preset, backend), _triton_options(_builds, preset, backend))
        root, model = _builds.checkpoint(preset, f"{preset}-{backend}")
        return root / "ckpt", out, model

    return get


@pytest.fixture(scope="session")
def tvm_compiled(_builds):
    """tvm_compiled(preset) -> (eager fp32 model, checkpoint dir, arts(dtype) -> artifact dir): the preset's seed-1
    f32 checkpoint (MXFP4 routed experts for MXFP4_PRESET, like the published ones) and its artifacts for
    `cpu-x86-64` with the TVM backend at max_batch 3, max_seq TVM_PROMPT + TVM_STEPS, max_prefill TVM_PROMPT in
    `dtype` ("f32" | "bf16"), each compiled once per session."""

    def get(preset: str):
        root, model = _builds.checkpoint(preset, f"{preset}-tvm")
        return model, root / "ckpt", lambda dtype: _builds.get(("tvm", preset, dtype),
                                                                _tvm_options(_builds, preset, dtype))[0]

    return get


@pytest.fixture(scope="session")
def tp_compiled(_builds):
    """tp_compiled(preset, tp) -> (artifact dir, compile summary): `tvm_compiled(preset)`'s checkpoint compiled for
    `cpu-x86-64` (TVM kernels) at `tp` ranks with `--ep tp_ep(preset, tp)`, max_batch 3, max_seq PROMPT + TP_STEPS,
    max_prefill MAX_PREFILL (so the prompt is prefilled in calls of MAX_PREFILL and PROMPT - MAX_PREFILL tokens)."""
    return lambda preset, tp: _builds.get(("tp", preset, tp), _tp_options(_builds, preset, tp))


@pytest.fixture(scope="session", autouse=True)
def _prefetch(request, _builds):
    """Queue, in the order the selected tests run, every artifact they ask for through a preset parameter or the
    tensor-parallel worlds (a test that names its preset in its body compiles on first use)."""
    for item in request.session.items:
        names = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "compiled" in names and "preset" in params and "backend" in params:
            preset, backend = params["preset"], params["backend"]
            _builds.submit(("triton", preset, backend), _triton_options(_builds, preset, backend))
        if "tvm_compiled" in names and params.get("compiled") in TINY_PRESETS:  # test_tvm_end_to_end's presets
            _builds.submit(("tvm", params["compiled"], "f32"), _tvm_options(_builds, params["compiled"], "f32"))
        if "tp_artifacts" in names:  # every world runs every preset against its TP = 1 artifact
            for preset in TINY_PRESETS:
                _builds.submit(("tvm", preset, "f32"), _tvm_options(_builds, preset, "f32"))
            for tp in TP_WORLDS:
                for preset in TINY_PRESETS:
                    _builds.submit(("tp", preset, tp), _tp_options(_builds, preset, tp))
