"""Targets: presets carry their datasheet figures, JSON targets load with clear errors, roofline arithmetic."""

import json

import pytest

from k3c.errors import ConfigError, UnsupportedError
from k3c.targets import PRESETS, Target, load_target, roofline, roofline_bound, roofline_time, target_from_dict


def test_h200_datasheet_and_measured_figures():
    t = load_target("h200")
    assert (t.kind, t.arch, t.compute_units) == ("cuda", "sm_90", 132)
    assert t.memory_bytes == 141_000_000_000 and t.hbm_bandwidth == 4.8e12
    assert t.peak("bf16") == 989.5e12 and t.peak("fp8") == 1979e12
    assert t.bandwidth(measured=True) == 4.3e12 and t.peak("bfloat16", measured=True) == 788e12
    assert t.peak("fp8", measured=True) == 1979e12  # no measurement: falls back to the spec
    assert "datasheet" in t.sources["*"] and "KINDS.md" in t.sources["measured"]


def test_every_preset_is_sourced_and_round_trips():
    assert {"h200", "h100-sxm", "b200", "gb200", "a100-80g", "mi300x", "cpu-x86-64", "cpu-aarch64"} <= set(PRESETS)
    for name, t in PRESETS.items():
        assert t.sources.get("*"), name
        assert target_from_dict(json.loads(json.dumps(t.to_dict())), name) == t


def test_ridge_points_match_vendor_ratios():
    # dense bf16 FLOP per byte: H200 989.5/4.8 ≈ 206, H100 989.5/3.35 ≈ 295 (device H200.md gives the same)
    assert round(PRESETS["h200"].peak("bf16") / PRESETS["h200"].hbm_bandwidth) == 206
    assert round(PRESETS["h100-sxm"].peak("bf16") / PRESETS["h100-sxm"].hbm_bandwidth) == 295


def test_roofline_time_and_bound():
    t = load_target("h100-sxm")
    # 8192^3 GEMM in bf16: 2·8192^3 FLOP = 1.0995e12 FLOP -> 1.111 ms at 989.5 TFLOP/s; 402,653,184 bytes -> 0.12 ms
    r = roofline(2 * 8192**3, 3 * 8192**2 * 2, t, "bf16")
    assert r.bound == "compute" and r.time_s == pytest.approx(1.0995116e12 / 989.5e12)
    assert r.memory_s == pytest.approx(402_653_184 / 3.35e12)
    # decode GEMV 7168x7168 bf16: 102.8 MB read, 1.03e8 FLOP -> memory-bound at 3.35 TB/s
    assert roofline_bound(2 * 7168**2, 7168**2 * 2, t, "bf16") == "memory"
    assert roofline_time(2 * 7168**2, 7168**2 * 2, t, "bf16") == pytest.approx(7168**2 * 2 / 3.35e12)
    with pytest.raises(UnsupportedError, match="float4"):
        roofline_time(1, 1, t, "fp4")


def test_json_target(tmp_path):
    path = tmp_path / "chip.json"
    path.write_text(json.dumps({"name": "chip", "kind": "cuda", "arch": "sm_90", "memory_bytes": 1e9,
                                "hbm_bandwidth": 1e12, "peak_flops": {"bf16": 1e14}}))
    t = load_target(str(path))
    assert isinstance(t, Target) and t.peak("bfloat16") == 1e14 and t.interconnect_bandwidth is None


@pytest.mark.parametrize("patch, match", [
    ({"kind": "tpu"}, "field 'kind'"),
    ({"peak_flops": {"bf16": -1}}, "peak_flops.bf16"),
    ({"peak_flops": {"fp7": 1e12}}, "peak_flops.fp7"),
    ({"hbm_bandwidth": "fast"}, "field 'hbm_bandwidth'"),
    ({"speed": 3}, "unknown field 'speed'"),
    ({"measured": {"hbm_bw": 1e12}}, "measured.hbm_bw"),
    ({"memory_bytes": float("inf")}, "field 'memory_bytes' must be a finite number > 0, got inf"),
    ({"memory_bytes": 10 ** 400}, "field 'memory_bytes' must be a finite number > 0, got 1000"),
    ({"peak_flops": {"bf16": float("nan")}}, "peak_flops.bf16' must be a finite number"),
    ({"measured": {"hbm_bandwidth": 10 ** 400}}, "measured.hbm_bandwidth' is not a known figure with a finite"),
    ({"compute_units": 1.5}, "field 'compute_units' has type float, expected an integer"),
    ({"backends": "triton"}, "field 'backends' has type str, expected a list"),
])
def test_json_target_errors_name_file_and_field(tmp_path, patch, match):
    data = {"name": "chip", "kind": "cuda", "arch": "sm_90", "memory_bytes": 1e9, "hbm_bandwidth": 1e12,
            "peak_flops": {"bf16": 1e14}, **patch}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match) as err:
        load_target(path)
    assert "bad.json" in str(err.value)


def test_missing_field_bad_json_and_unknown_name(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"name": "x", "kind": "cpu", "arch": "x86-64"}))
    with pytest.raises(ConfigError, match="t.json: missing field 'memory_bytes'"):
        load_target(path)
    path.write_text("{nope")
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_target(path)
    for text in (b"\xff\xfe{}", b"[" * 100000, b'{"memory_bytes": ' + b"9" * 5000 + b"}"):  # not UTF-8; deep; huge
        path.write_bytes(text)
        with pytest.raises(ConfigError, match="t.json: not a target JSON file"):
            load_target(path)
    with pytest.raises(ConfigError, match="not a preset .*h200"):
        load_target("h300")
    with pytest.raises(ConfigError, match="cannot read"):
        load_target(str(tmp_path / "missing.json"))
