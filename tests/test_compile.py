"""`k3c compile --plan-only`: the artifact, its memory plan and pools, determinism and bad options."""

from __future__ import annotations

import gc
import json

import pytest

from k3c.compile import CompileOptions, compile_model
from k3c.errors import ConfigError, UnsupportedError
from k3c.runtime.artifact import read_artifact


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("art")
    opts = CompileOptions("k3.1-pro-tiny", root / "a", max_batch=2, max_seq=256, max_prefill=64, plan_only=True,
                          report=True)
    summary = compile_model(opts)
    return root, opts, summary


def test_artifact_reads_back_with_hashes(built):
    root, opts, _ = built
    art = read_artifact(opts.out)
    plan = json.loads((opts.out / "plan.json").read_text())
    assert set(plan["arena"]) == {"prefill", "decode"}
    assert plan["bounds"]["prefill"] == {"B": 2, "T": 64, "L": 192}
    assert art.manifest["bounds"]["max_seq"] == 256


def test_arena_close_to_liveness_lower_bound(built):
    _, opts, s = built
    for entry in ("prefill", "decode"):
        assert s["lower_bound"][entry] <= s["arena"][entry] <= 1.05 * s["lower_bound"][entry]


def test_pools_match_config_arithmetic(built):
    _, opts, s = built
    # k3.1-pro-tiny: 7 KDA layers x B=2 x 4 heads x 16 x 16 fp32 states, conv states 3*64 channels x 4 bf16 (the
    # projections' dtype); 3 global layers x 2 x 256 tokens x (32 + 8) bf16 latents; 3 DSA layers x 2 x 256 x 16
    # bf16 index keys
    assert s["pools"]["kda_state"] == 7 * 2 * 4 * 16 * 16 * 4
    assert s["pools"]["conv_state"] == 7 * 2 * 192 * 4 * 2
    assert s["pools"]["kv"] == 3 * 2 * 256 * 40 * 2
    assert s["pools"]["index_k"] == 3 * 2 * 256 * 16 * 2


def test_gc_is_back_on_after_a_compile(built):
    assert gc.isenabled()  # compile_model pauses the cyclic GC while it runs


def test_same_input_gives_byte_identical_artifact(built):
    root, opts, _ = built
    again = CompileOptions(opts.model, root / "b", max_batch=2, max_seq=256, max_prefill=64, plan_only=True,
                           report=True)
    compile_model(again)
    files = sorted(p.relative_to(opts.out) for p in opts.out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again.out) for p in again.out.rglob("*") if p.is_file())
    for f in files:
        assert (opts.out / f).read_bytes() == (again.out / f).read_bytes(), f


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="--max-prefill"):
        compile_model(CompileOptions("k3-tiny", tmp_path / "x", max_seq=16, max_prefill=64, plan_only=True))
    with pytest.raises(UnsupportedError, match="--plan-only"):
        compile_model(CompileOptions("k3-tiny", tmp_path / "y"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_mxfp4_experts_in_the_plan(built, tmp_path):
    """--experts-dtype mxfp4 (a plan-only build of a preset) counts each routed expert weight at 4.25 bits; the
    default for a config without quantization_config keeps them dense; bad values are one-line errors."""
    from models.checkpoint import save_random_checkpoint
    from models.config import K3Config

    root, opts, dense = built
    cfg = K3Config.from_pretrained("k3.1-pro-tiny")
    mx = compile_model(CompileOptions("k3.1-pro-tiny", root / "mx", max_batch=2, max_seq=256, max_prefill=64,
                                      plan_only=True, experts_dtype="mxfp4"))
    moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    n = moe * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size
    assert dense["weights"]["experts"] == n * 2 and mx["weights"]["experts"] * 32 == n * 17     # bf16 vs 17/32 B
    assert dense["weights"]["total"] - mx["weights"]["total"] == n * 2 - n * 17 // 32
    assert json.loads((root / "mx" / "plan.json").read_text())["weights"] == mx["weights"]
    with pytest.raises(ConfigError, match="--experts-dtype fp8"):
        compile_model(CompileOptions("k3-tiny", tmp_path / "x", plan_only=True, experts_dtype="fp8"))
    save_random_checkpoint("k3-tiny", tmp_path / "ckpt", expert_format="dense")
    with pytest.raises(ConfigError, match="stores dense experts"):
        compile_model(CompileOptions(str(tmp_path / "ckpt"), tmp_path / "y", experts_dtype="mxfp4", dtype="f32"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
