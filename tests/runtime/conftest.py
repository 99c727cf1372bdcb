"""Compiled artifacts shared by the runtime tests: each (preset, backend) once per session, each preset's native TVM
artifacts (shared by the TVM end-to-end and the tensor-parallel tests) and its TP = 2 / 4 ones; the sizes and the
reasons for them are in runtime_sizes.py.

Compiles run in a spawned compiler process (`compile_pool`), and every artifact that the selected tests ask for
is submitted before the first runtime test runs (`_prefetch`): the test process interprets Triton kernels on one
core for minutes while CI's second core would idle, and a TVM build takes tens of seconds of one core, so the
builds overlap the interpreted tests instead of following them (one process: a second would take CPU from the
interpreted tests, the longest path, and its work fits beside them). The artifacts are the ones a compile in the test
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
from tp_ranks import compile_and_run  # noqa: E402


class _Builds:
    """Jobs by key (an artifact's compile, or a tensor-parallel world's compiles and run), each run once per
    session: in the pool when submitted ahead (`submit`), else (or when its job had not started) in this process
    (`get`). Seed-1 f32 checkpoints, one per (preset, root name)."""

    def __init__(self, pool: ProcessPoolExecutor, tmp_path_factory):
        self.pool, self.tmp = pool, tmp_path_factory
        self.roots: dict[str, tuple] = {}
        self.jobs: dict[tuple, Future | None] = {}
        self.done: dict[tuple, object] = {}

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

    def submit(self, key: tuple, job) -> None:
        """Queue `fn(*args)` in the pool under `key`, (fn, args) = job(), unless known already."""
        if key not in self.jobs:
            fn, args = job()
            self.jobs[key] = self.pool.submit(fn, *args)

    def get(self, key: tuple, job):
        """The result of `key`'s job: the pool's, or `fn(*args)` here, (fn, args) = job(), if nobody started it."""
        if key not in self.done:
            queued = self.jobs.get(key)
            if queued is not None and not queued.cancel():
                self.done[key] = queued.result()
            else:
                fn, args = job()
                self.done[key] = fn(*args)
            self.jobs[key] = None
        return self.done[key]


@pytest.fixture(scope="session")
def compile_pool():
    """One spawned process that runs the compiles and worlds (the module docstring says why). At the end of the session
    queued jobs are dropped and the worker exits without the session waiting (a process that imported torch and
    tvm takes seconds to exit; Python joins it when it exits itself)."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def _builds(compile_pool, tmp_path_factory) -> _Builds:
    return _Builds(compile_pool, tmp_path_factory)


def _triton_options(builds: _Builds, preset: str, backend: str) -> CompileOptions:
    root, _ = builds.checkpoint(preset, f"{preset}-{backend}")
    return CompileOptions(str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=MAX_BATCH, max_seq=MAX_SEQ,
                          max_prefill=MAX_PREFILL, dtype="f32", backend=backend, all_logits=preset == TINY_PRESETS[0])


def _tvm_options(builds: _Builds, preset: str, dtype: str) -> CompileOptions:
    root, _ = builds.checkpoint(preset, f"{preset}-tvm")
    return CompileOptions(str(root / "ckpt"), root / f"art_{dtype}", target="cpu-x86-64", max_batch=3,
                          max_seq=TVM_PROMPT + TVM_STEPS, max_prefill=TVM_PROMPT, dtype=dtype, backend="tvm")


def _tp_options(builds: _Builds, preset: str, tp: int) -> CompileOptions:
    root, _ = builds.checkpoint(preset, f"{preset}-tvm")
    return CompileOptions(str(root / "ckpt"), root / f"tp{tp}", target="cpu-x86-64", tp=tp, ep=tp_ep(preset, tp),
                          max_batch=3, max_seq=PROMPT + TP_STEPS, max_prefill=MAX_PREFILL, dtype="f32", backend="tvm")


def _compile_job(options):
    return lambda: (compile_model, (options(),))


def _world_job(builds: _Builds, world: int):
    """(fn, args) of the TP = `world` world: `tp_ranks.compile_and_run` of every tiny preset's `_tp_options`."""
    def job():
        _world_dir(builds, world).mkdir(exist_ok=True)
        return compile_and_run, (world, {p: _tp_options(builds, p, world) for p in TINY_PRESETS},
                                 str(_world_dir(builds, world)))
    return job


def _world_dir(builds: _Builds, world: int):
    return builds.tmp.getbasetemp() / f"world{world}"


@pytest.fixture(scope="session")
def compiled(_builds):
    """compiled(preset, backend="triton") -> (checkpoint dir, artifact dir, fp32 reference model): `preset`
    compiled f32 for the CPU target with `backend` at MAX_BATCH / MAX_SEQ / MAX_PREFILL (and `prefill_all` for the
    first preset), once per session and shared by every test that asks (copy the artifact before changing it)."""

    def get(preset: str, backend: str = "triton"):
        opts = _triton_options(_builds, preset, backend)
        _builds.get(("triton", preset, backend), _compile_job(lambda: opts))
        root, model = _builds.checkpoint(preset, f"{preset}-{backend}")
        return root / "ckpt", opts.out, model

    return get


@pytest.fixture(scope="session")
def tvm_compiled(_builds):
    """tvm_compiled(preset) -> (eager fp32 model, checkpoint dir, arts(dtype) -> artifact dir): the preset's seed-1
    f32 checkpoint (MXFP4 routed experts for MXFP4_PRESET, like the published ones) and its artifacts for
    `cpu-x86-64` with the TVM backend at max_batch 3, max_seq TVM_PROMPT + TVM_STEPS, max_prefill TVM_PROMPT in
    `dtype` ("f32" | "bf16"), each compiled once per session."""

    def get(preset: str):
        root, model = _builds.checkpoint(preset, f"{preset}-tvm")

        def arts(dtype: str):
            opts = _tvm_options(_builds, preset, dtype)
            _builds.get(("tvm", preset, dtype), _compile_job(lambda: opts))
            return opts.out

        return model, root / "ckpt", arts

    return get


@pytest.fixture(scope="session")
def tp_world(_builds):
    """tp_world(world) -> ({preset: (artifact dir, compile summary)}, [what each rank saved]): every tiny preset's
    `tvm_compiled` checkpoint compiled for `cpu-x86-64` (TVM kernels) at tp = `world` ranks with `--ep
    tp_ep(preset, world)`, max_batch 3, max_seq PROMPT + TP_STEPS, max_prefill MAX_PREFILL (the prompt is prefilled
    in calls of MAX_PREFILL and PROMPT - MAX_PREFILL tokens), then run by a spawned gloo world of `world` processes
    (`tp_ranks.compile_and_run`; in the pool when prefetched, so the world runs beside the interpreted tests)."""

    def get(world: int):
        summaries = _builds.get(("world", world), _world_job(_builds, world))
        ranks = [torch.load(_world_dir(_builds, world) / f"rank{r}.pt") for r in range(world)]
        return {p: (_tp_options(_builds, p, world).out, summaries[p]) for p in TINY_PRESETS}, ranks

    return get


@pytest.fixture(scope="session", autouse=True)
def _prefetch(request, _builds):
    """Queue, in the order the selected tests run, every artifact they ask for through a preset parameter or the
    tensor-parallel worlds (a test that names its preset in its body compiles on first use)."""
    for item in request.session.items:
        names = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "compiled" in names and "preset" in params and "backend" in params:
            preset, backend = params["preset"], params["backend"]
            _builds.submit(("triton", preset, backend), _compile_job(lambda: _triton_options(_builds, preset, backend)))
        if "tvm_compiled" in names and params.get("compiled") in TINY_PRESETS:  # test_tvm_end_to_end's presets
            preset = params["compiled"]
            _builds.submit(("tvm", preset, "f32"), _compile_job(lambda: _tvm_options(_builds, preset, "f32")))
        if "tp_world" in names:  # every world runs every preset, compared with its TP = 1 artifact
            for preset in TINY_PRESETS:
                _builds.submit(("tvm", preset, "f32"), _compile_job(lambda: _tvm_options(_builds, preset, "f32")))
            for world in TP_WORLDS:
                _builds.submit(("world", world), _world_job(_builds, world))
