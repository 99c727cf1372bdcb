"""Hardware retargeting estimates, checked against arithmetic from the published configs and K3-SPEC.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from k3c.context import DSA_RERANK_EXTRA
from k3c.errors import ConfigError
from k3c.retarget import MXFP4_BITS, estimate, weights
from models.config import K3Config


@pytest.fixture(scope="module")
def k3():
    return K3Config.from_pretrained("k3")


def test_k3_parameter_count_matches_the_report(k3):
    """K3 report (seeds/k3-architecture-summary): 2.78T total, 104.2B active. The experts alone are
    92 MoE layers x 896 experts x 3 x 3072 x 3584 = 2.7235T, computed here independently of the model code."""
    w = weights(k3)
    assert w.expert_params == 92 * 896 * 3 * 3072 * 3584
    assert abs(w.params / 2.78e12 - 1) < 0.01
    e = estimate(k3, "h200", tp=16)
    assert abs(e.active_params_per_token / 104.2e9 - 1) < 0.02
    # MXFP4 experts: 4.25 bits per value
    assert w.expert_bytes == pytest.approx(w.expert_params * MXFP4_BITS / 8, rel=1e-9)


def test_k31_pro_pools_match_spec_arithmetic():
    cfg = K3Config.from_pretrained("k3.1-pro")
    e = estimate(cfg, "h200", tp=1, max_batch=1, max_seq=1 << 20)
    assert e.pools["mla_latent_kv"]["bytes"] == 24 * (1 << 20) * 576 * 2          # ~27.6 GB (K3-SPEC)
    assert e.pools["dsa_index_keys"]["bytes"] == 24 * (1 << 20) * 128              # FP8, ~3 GB at 1M tokens
    assert e.pools["kda_state"]["bytes"] == 69 * 96 * 128 * 128 * 4                # fp32 (K3-SPEC's 207 MiB is bf16)


def test_memory_fit_and_min_gpus(k3):
    e8, e16 = estimate(k3, "h200", tp=8), estimate(k3, "h200", tp=16)
    assert not e8.fits and e16.fits
    # per GPU = replicated R + split S / tp (k3c.parallel): two GPU counts give R and S, which add up to the model
    split = 16 * (e8.weight_bytes_per_gpu - e16.weight_bytes_per_gpu)
    replicated = e8.weight_bytes_per_gpu - split / 8
    assert replicated + split == pytest.approx(weights(k3).nbytes, rel=1e-6)
    assert 0 < replicated < 0.02 * weights(k3).nbytes  # norms, router, low-rank down projections, DSA indexer
    n = e16.min_gpus
    # the fewest GPUs that hold it is one answer, whichever GPU count the estimate is for (`k3c plan`'s footer
    # quotes its first row)
    assert {estimate(k3, "h200", tp=t).min_gpus for t in (1, 2, 4, 8, 16)} == {n}
    # n GPUs each hold R whole, S / n and their caches; n - 1 do not (the caches barely depend on the count: only
    # the KDA state splits, 1.5 % of them here)
    mem, pool = e16.memory_bytes, e16.pool_bytes_per_gpu
    assert replicated + split / n + pool <= mem < replicated + split / (n - 1) + pool
    assert e16.min_tp == 16 and n == 15       # 15 by memory; --tp 15 does not divide K3's 96 heads



def test_caches_beyond_one_gpu_give_no_gpu_count(k3):
    # the weights split over GPUs but each GPU keeps its caches whole: when those alone exceed a GPU's memory no
    # count holds the model (None, not 0), and `k3c plan` says so instead of "at least 0 GPUs"
    e = estimate(k3, "h200", tp=8, max_batch=8)
    assert e.pool_bytes_per_gpu > e.memory_bytes and e.min_gpus is None
    run = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3", "--tp", "8", "--max-batch", "8"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert "no GPU count holds it" in run.stdout and "at least 0" not in run.stdout


def test_bounds_beyond_2_31_are_refused(k3):
    # as `k3c compile` refuses them: a batch of 10**23 would otherwise print figures in yottabytes
    for kw in (dict(max_batch=2 ** 31), dict(max_seq=10 ** 23), dict(tp=2 ** 40)):
        with pytest.raises(ConfigError, match="must be below 2\\^31"):
            estimate(k3, "h200", **{"tp": 8, **kw})


def test_cli_plan_default_counts_are_those_that_split_the_model():
    # k3-tiny has 4 attention heads: of the default counts 1,2,4,8,16 only 1, 2 and 4 split it; a count given
    # explicitly that does not is an error naming the field
    run = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3-tiny", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert [r["tp"] for r in json.loads(run.stdout)] == [1, 2, 4]
    run = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3-tiny", "--tp", "8"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--tp 8 does not divide num_attention_heads = 4 of k3-tiny" in run.stderr


def test_cli_plan_on_a_target_without_an_interconnect_plans_one_device():
    # the default GPU counts (1,2,4,8,16) need an interconnect; a CPU target has none, so its default is one device
    run = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3-tiny", "--target", "cpu-x86-64", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [r["tp"] for r in rows] == [1] and rows[0]["min_gpus"] == 1


def test_cli_plan_piped_keeps_its_headers():
    # stdout is a pipe without COLUMNS: the table is laid out wide enough for its headers, not cut to 80 columns
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    run = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3.1-pro"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert all(h in run.stdout for h in ("weights/GPU", "caches/GPU", "total/GPU", "decode step")), run.stdout
    assert "at least 15 GPUs needed (the fewest --tp from there: 16)" in " ".join(run.stdout.split())   # wraps

def test_decode_roofline_scales_with_gpus_and_context(k3):
    a, b = estimate(k3, "h200", tp=8, context=4096), estimate(k3, "h200", tp=16, context=4096)
    assert b.decode_step_s < a.decode_step_s and a.decode_bound == "memory"
    long = estimate(k3, "h200", tp=16, context=1 << 20)
    assert long.decode_bytes_per_gpu > b.decode_bytes_per_gpu


def test_plan_refuses_a_layout_the_compiler_refuses(k3):
    with pytest.raises(ConfigError, match="--tp 5 does not divide num_attention_heads = 96"):
        estimate(k3, "h200", tp=5)


def test_cli_plan_bad_tp_is_one_line_error():
    r = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3", "--tp", "x"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--tp" in r.stderr
    r = subprocess.run([sys.executable, "-m", "k3c.cli", "plan", "k3", "--experts-dtype", "fp3"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: --experts-dtype fp3: expected mxfp4 or bf16"


def test_estimate_refuses_bounds_the_model_or_the_caches_cannot_have():
    cfg = K3Config.from_pretrained("k3")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        estimate(cfg, "h200", max_seq=cfg.max_position_embeddings + 1)
    for context in (-1, 1 << 21):
        with pytest.raises(ConfigError, match=r"context .* \[0, max_seq 1048576\]"):
            estimate(cfg, "h200", max_seq=1 << 20, context=context)


def test_experts_dtype_before_and_after():
    """`k3c plan --experts-dtype bf16` sizes the dequantized build k3c made before MXFP4 kernels: 2 bytes per expert
    weight instead of 4.25 bits, so K3.1 Pro at 1M context needs 53 H200s instead of 15 (each GPU the replicated
    weights whole, its share of the rest and its own caches: the KDA heads split, the latent caches whole)."""
    cfg = K3Config.from_pretrained("k3.1-pro")
    mx, bf = weights(cfg), weights(cfg, experts_dtype="bf16")
    assert bf.expert_bytes == bf.expert_params * 2 and mx.expert_params == bf.expert_params
    assert bf.nbytes - mx.nbytes == bf.expert_bytes - mx.expert_bytes
    assert (estimate(cfg, "h200").min_gpus, estimate(cfg, "h200", experts_dtype="bf16").min_gpus) == (15, 53)
    with pytest.raises(ConfigError, match="expected mxfp4 or bf16"):
        weights(cfg, experts_dtype="fp8")


def test_plan_counts_a_bf16_state_at_half_the_bytes():
    """`k3c plan --kda-state bf16`: the state pool at 2 bytes per element instead of 4 (K3-SPEC "Sizes": K3.1 Pro's
    69 x 96 x 128 x 128 x 2 B = 207 MiB per sequence), and a decode step, which reads and writes the whole state,
    moves 2 x 2 bytes less per element."""
    cfg = K3Config.from_pretrained("k3.1-pro-tiny")
    for tp in (1, 2):  # each GPU holds, reads and writes the state of its own 1/tp of the heads
        f32, bf16 = (estimate(cfg, "h200", tp, max_batch=16, max_seq=4096, kda_state_dtype=d) for d in ("f32", "bf16"))
        n = 16 * sum(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers)) * cfg.kda_num_heads // tp * \
            cfg.kda_head_dim ** 2
        assert (f32.pools["kda_state"]["bytes"], bf16.pools["kda_state"]["bytes"]) == (4 * n, 2 * n)
        assert f32.pool_bytes_per_gpu - bf16.pool_bytes_per_gpu == 2 * n
        assert f32.decode_bytes_per_gpu - bf16.decode_bytes_per_gpu == pytest.approx(2 * 2 * n)
    with pytest.raises(ConfigError, match=r"^--kda-state fp8 \(kda_state_dtype\): expected one of f32, bf16$"):
        estimate(cfg, "h200", kda_state_dtype="fp8")


def test_plan_counts_fp8_index_keys_with_their_scales_and_residuals():
    """`k3c plan --dsa-index-keys`: fp8 (the default, K3-SPEC "Sizes": 128 B per token per DSA layer) adds one f32
    scale per key, as `k3c compile --dsa-index-keys fp8` stores them; bf16 keys are 2 B per value; fp8-rerank adds
    4 bits per value. A decode step reads every cached key of every DSA layer once (fp8-rerank: and the topk + E
    candidates' keys, scales and residuals)."""
    cfg = K3Config.from_pretrained("k3.1-pro")
    fp8, bf16 = (estimate(cfg, "h200", 16, max_batch=2, max_seq=1 << 17, dsa_index_keys=d) for d in ("fp8", "bf16"))
    n = 24 * 2 * (1 << 17)                                  # DSA layers x sequences x tokens
    assert fp8.pools["dsa_index_keys"] == {"shape": [24, 2, 1 << 17, 128], "dtype": "float8_e4m3fn",
                                           "bytes": n * 128, "doc": fp8.pools["dsa_index_keys"]["doc"]}
    assert fp8.pools["dsa_index_scales"]["bytes"] == n * 4 and "dsa_index_scales" not in bf16.pools
    assert bf16.pools["dsa_index_keys"]["bytes"] == n * 256
    assert bf16.pool_bytes_per_gpu - fp8.pool_bytes_per_gpu == n * (256 - 132)
    assert (bf16.decode_bytes_per_gpu - fp8.decode_bytes_per_gpu) * 16 == pytest.approx(n * (256 - 132))
    with pytest.raises(ConfigError, match=r"^--dsa-index-keys fp16 \(dsa_index_keys\): expected one of bf16, fp8, "
                                          r"fp8-rerank$"):
        estimate(cfg, "h200", dsa_index_keys="fp16")
    rr = estimate(cfg, "h200", 16, max_batch=2, max_seq=1 << 17, dsa_index_keys="fp8-rerank")   # + 4-bit residuals
    assert rr.pools["dsa_index_residuals"] == {"shape": [24, 2, 1 << 17, 64], "dtype": "uint8", "bytes": n * 64,
                                               "doc": rr.pools["dsa_index_residuals"]["doc"]}
    assert rr.pool_bytes_per_gpu - fp8.pool_bytes_per_gpu == n * 64 and "dsa_index_residuals" not in fp8.pools
    extra = 24 * 2 * (2048 + DSA_RERANK_EXTRA) * (128 + 64 + 4)     # the re-ranked candidates' keys per decode step
    assert (rr.decode_bytes_per_gpu - fp8.decode_bytes_per_gpu) * 16 == pytest.approx(extra)


def test_index_key_storage_only_for_models_with_dsa_layers(k3):
    # K3 (gated MLA, no DSA): the default stores no index keys and says nothing of them; asking for fp8 keys is the
    # ConfigError `k3c compile` gives, and so is `k3c check` (one rule: k3c.context.check_dsa_index_keys_for)
    assert "dsa_index_keys" not in estimate(k3, "h200", tp=16).pools
    with pytest.raises(ConfigError, match=r"k3 has no DSA layers \(config: dsa_config\.dsa_layers\)"):
        estimate(k3, "h200", tp=16, dsa_index_keys="fp8")
    pro = K3Config.from_pretrained("k3.1-pro")
    assert estimate(pro, "h200", tp=16).pools["dsa_index_keys"]["bytes"] == 24 * (1 << 20) * 128   # fp8 default
    run = subprocess.run([sys.executable, "-m", "k3c.cli", "check", "k3-tiny", "--dsa-index-keys", "fp8"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "k3-tiny has no DSA layers" in run.stderr
