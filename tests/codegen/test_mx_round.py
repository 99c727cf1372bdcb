"""benchmarks/mx_round.py's decisions, without a GPU: which probe variant wins, the mx_config it stands for, and
the copy of `mx_default_config` that makes the end-to-end benchmark run it."""

import importlib.util
import os
import types

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
spec = importlib.util.spec_from_file_location("mx_round", os.path.join(ROOT, "benchmarks", "mx_round.py"))
mx_round = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mx_round)


def row(variant, N, up, down, diff=0.0, ref=2.0):
    return {"variant": variant, "N": N, "up_us": up, "down_us": down, "max_abs_diff": diff, "ref_max_abs": ref}


def test_choose_takes_the_fastest_variant_that_agrees_with_the_default():
    a, b, c, d = "8,32,2,1,0,0,80", "8,32,2,2,0,80,80", "8,32,2,2,2,80,80", "16,32,2,0,0,128,80"
    rows = [row(a, 1, 60, 30), row(a, 16, 150, 80),
            row(b, 1, 55, 30), row(b, 16, 140, 80),
            row(c, 1, 50, 20, 1e-3), row(c, 16, 100, 60, 1e-3),      # fastest, but the same K order: not bitwise
            row(d, 16, 130, 70),                                      # 16-token tiles: batch 16 only
            {"variant": "8,32,1,2,2,0,0", "N": 1, "error": "spill"}]
    assert mx_round.choose(rows, 1, a) == b
    assert mx_round.choose(rows, 16, a) == d
    assert mx_round.choose(rows, 64, a) == a                        # nothing timed: the default stays
    # a winner must beat the default by 2 %: 88.5 us against 90 is noise
    assert mx_round.choose([row(a, 1, 60, 30), row(b, 1, 58.5, 30)], 1, a) == a
    # 128-wide K tiles sum in another order: a few bf16 roundings of the largest output (2.0) are agreement,
    # a wrong value is not
    k128 = "8,32,1,2,2,64,64,128"
    assert mx_round.choose(rows + [row(k128, 1, 40, 20, 2 ** -6)], 1, a) == k128
    # rows as mx_round.json keeps them (every key, "error": None where the variant ran) count as timed
    saved = [{"error": None, **r} for r in rows if "error" not in r]
    assert mx_round.choose(saved, 1, a) == b and mx_round.choose(saved, 16, a) == d
    assert mx_round.choose(rows + [row(k128, 1, 40, 20, 0.1)], 1, a) == b


def test_best_mix_joins_one_variants_up_kernel_to_anothers_down_kernel():
    # the up kernel of "reg" (register stream, 128-wide K tiles) is the fastest, the down kernel of "ring" (TMA
    # ring, capped) too: their mix is predicted at 50 + 24 us against 79 for the best whole variant
    base, reg, ring = "8,32,2,1,0,0,80", "8,32,1,2,2,80,80,128", "8,32,2,2,0,80,80"
    rows = [row(base, 1, 60, 30), row(reg, 1, 50, 30, 2 ** -7), row(ring, 1, 55, 24)]
    mix = mx_round.best_mix(rows, 1, base)
    assert mix == "8,32,1/2,2,0,80,80,128/256"
    assert mx_round.variant_config(mix) == (8, 32, (128, 256), 2, (1, 2), False, (80, 80), (2, 0))
    assert mx_round.kernel_fields(mix) == (8, (32, 1, 2, 80, 128), (32, 2, 0, 80, 256))
    # a prediction until timed: the choice is the best whole variant; timed (its row last), the mix wins
    assert mx_round.choose(rows, 1, base) == ring
    assert mx_round.choose(rows + [row(mix, 1, 51, 25, 2 ** -7)], 1, base) == mix
    # timed and slower than predicted: the whole variant stays
    assert mx_round.choose(rows + [row(mix, 1, 56, 26, 2 ** -7)], 1, base) == ring
    # nothing to time: the fastest kernels come from one variant, the mix was timed, or it gains under 1 %
    assert mx_round.best_mix([row(base, 1, 60, 30), row(ring, 1, 55, 24)], 1, base) is None
    assert mx_round.best_mix(rows + [row(mix, 1, 56, 26, 2 ** -7)], 1, base) is None
    assert mx_round.best_mix([row(reg, 1, 50, 30, 2 ** -7), row(ring, 1, 55, 29.6)], 1, base) is None  # 79.6, 80
    # only variants that agree with the default, and only kernels of one token tile, are joined
    assert mx_round.best_mix([row(base, 1, 60, 30), row(reg, 1, 50, 30, 0.1), row(ring, 1, 55, 24)], 1, base) is None
    wide = "16,32,2,0,0,128,80"
    assert mx_round.best_mix([row(base, 16, 150, 80), row(wide, 16, 120, 90)], 16, base) is None
    assert mx_round.best_mix([row(base, 1, 60, 30), row(wide, 1, 40, 20)], 16, base) is None   # other batch


def test_default_variant_is_the_launchers_decode_default():
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    # mx27's default: 8-token tiles of 32 rows on a 2-stage TMA ring, the down kernel's activations loaded at use
    # and capped at 80 registers; the up kernel's K loop unrolled by two with its activations one tile ahead (mode
    # 2: run Q's below 4 rows per expert)
    assert mx_round.default_variant(1) == "8,32,2,2,0,0,80"
    assert mx_round.variant_config("8,32,2,2,0,0,80") == mx_default_config(16, 32, 122)
    # batch 16 of 32 experts (8 rows an expert) takes the `wgmma` kernels (run S), which this round does not probe
    assert mx_round.default_variant(16) is None and mx_default_config(16 * 16, 32, 122)[7] == (4, 4)
    # a card with its own decode config below 4 rows per expert (`MX_DECODE_BY_DEVICE`: the H100 SXM, run N)
    h100 = "NVIDIA H100 80GB HBM3"
    assert mx_round.default_variant(1, h100) == "8,32,4/2,1,0,0,80"
    assert mx_round.variant_config("8,32,4/2,1,0,0,80") == mx_default_config(16, 32, 122, h100)
    assert mx_round.default_variant(16, h100) is None
    assert mx_round.default_variant(1, "NVIDIA H200") == "8,32,2,2,0,0,80"
    assert mx_round.variant_config("8,32,2,2,2,80,80") == (8, 32, 256, 2, 2, False, (80, 80), (2, 2))
    assert mx_round.variant_config("8,32,1,2,2,80,0,128") == (8, 32, 128, 2, 1, False, (80, None), (2, 2))
    # fields of one kernel each: 32 rows on 2 warps and 16 on 1, register stream and ring, K tiles 128 and 256
    assert mx_round.variant_config("8,32/16,1/2,2,0,80,80,128/256") == \
        (8, (32, 16), (128, 256), (2, 1), (1, 2), False, (80, 80), (2, 0))
    assert mx_round.variant_text(*mx_round.kernel_fields("8,32/32,2/2,1,0,0,80,256/256")) == "8,32,2,1,0,0,80"
    for bad in ("8,32,2,3,0,0,80", "8,32,2,1,0,0,80,64", "8,32,2,1,0,0", "8,32,2,1,0,0,80,256,1", "8,x,2,1,0,0,80",
                "8,64,2,1,0,0,80", "8,32/64,2,1,0,0,80"):             # the last two: 32 weight rows a warp
        with pytest.raises(ValueError, match="variant"):
            mx_round.variant_config(bad)
    # every candidate is a configuration the Gluon kernels take at K3.1 Pro's shapes (mode 2: even K tile counts)
    from k3c.codegen.triton.moe_mxfp4 import mx_block_k
    from k3c.codegen.triton.moe_mxfp4_gluon import gluon_decode_ok

    for spec in mx_round.VARIANTS.split(";"):
        cfg = mx_round.variant_config(spec)
        assert cfg[2] == (int(spec.split(",")[7]) if spec.count(",") == 7 else 256)
        assert gluon_decode_ok(cfg, 3584, 3072, mx_block_k(3584, cfg[2]), mx_block_k(3072, cfg[2])), spec


def test_patched_default_returns_the_winners_for_decode_only():
    path = os.path.join(ROOT, "k3c", "codegen", "triton", "moe_mxfp4.py")
    with open(path) as f:
        source = f.read()
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    small, large = mx_round.variant_config("8,32,2,2,0,80,80"), mx_round.variant_config("16,32,2,0,0,128,80")
    for pair in ((small, small), (small, large)):
        module = types.ModuleType("patched_moe_mxfp4")
        exec(compile(mx_round.patched_default(source, *pair), path, "exec"), module.__dict__)
        assert module.mx_default_config(16, 32, 122) == pair[0]                 # batch 1: 0.5 rows per expert
        assert module.mx_default_config(16 * 16, 896, 122) == pair[0]          # batch 16 of 896: 0.29
        assert module.mx_default_config(16 * 16, 32, 122) == pair[1]           # batch 16 of 32: 8
        # on every card: a card's own entry (`MX_DECODE_BY_DEVICE`) does not override the winners in the copy
        assert module.mx_default_config(16, 32, 122, "NVIDIA H100 80GB HBM3") == pair[0]
        # two multiplies (scale bytes above 128) and prefill keep their configurations
        for rows, scale_max in ((16, 255), (4096, 122)):
            assert module.mx_default_config(rows, 32, scale_max) == mx_default_config(rows, 32, scale_max)
    with pytest.raises(ValueError, match="not found exactly once"):
        mx_round.patched_default(source.replace("if not two and rows < 16 * E:", "if rows < 16 * E:"), small, small)
    with pytest.raises(ValueError, match=r"MX_DECODE_BY_DEVICE.get\(device\) not found exactly once"):
        mx_round.patched_default(source.replace("MX_DECODE_BY_DEVICE.get(device)", "{}.get(device)"), small, small)


def test_the_copy_is_what_the_end_to_end_run_imports(tmp_path):
    # the run's environment imports k3c from the patched copy and sees the winners there; the checkout is untouched
    small, large = mx_round.variant_config("8,32,1,2,2,64,64,128"), mx_round.variant_config("16,32,2,0,0,128,80")
    cwd, env = mx_round.prepare_copy(str(tmp_path / "copy"), small, large)
    assert env["PYTHONPATH"].split(":")[0] == cwd
    assert os.path.isfile(os.path.join(cwd, "benchmarks", "bench_e2e.py"))
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    assert mx_default_config(16, 32, 122)[:7] == (8, 32, 256, 2, 2, False, (None, 80))


@pytest.mark.parametrize("args, message", [
    (["--scratch", "."], "must lie outside the checkout"),
    (["--scratch", "/"], "must lie outside the checkout"),
    (["--variants", "8,32,2,1,0,0,80,64"], "--variants: variant '8,32,2,1,0,0,80,64'"),
    (["--skip", "probe"], "phases are e2e, tests"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, args, message):
    import subprocess
    import sys

    out = tmp_path / "out"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mx_round.py"), "--out", str(out), *args],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr and not out.exists()


def test_the_round_times_the_mix_and_runs_the_end_to_end_benchmark_under_it(tmp_path, monkeypatch):
    # the whole round without a GPU: the phases' processes are replaced by ones that write what the real ones
    # write. First probe, at batch 1 alone (batch 16's default is the `wgmma` kernels, which the round does not
    # probe): "reg" has the fastest up kernel, "ring" the fastest down kernel. The second probe times their mix
    # beside the default; the end-to-end run then gets the mix for batch 1 and keeps batch 16's default
    import json
    import sys

    base, reg, ring, wide = "8,32,2,2,0,0,80", "8,32,1,2,2,80,80,128", "8,32,2,1,0,80,80", "16,32,2,0,0,128,80"
    mix = "8,32,1/2,2,0,80,80,128/256"                          # base: the default at batch 1 and 16
    times = {(base, 1): (60, 30), (reg, 1): (50, 30), (ring, 1): (55, 24), (mix, 1): (51, 24),
             (base, 16): (150, 80), (reg, 16): (150, 80), (ring, 16): (150, 79), (wide, 16): (120, 70)}
    calls = []

    def fake_run(cmd, seconds, log, cwd=mx_round.ROOT, env=None):
        script = os.path.basename(cmd[1]) if cmd[1].endswith(".py") else "pytest"
        calls.append((script, seconds))
        arg = dict(zip(cmd[2::2], cmd[3::2]))
        if script == "mx_tma_probe.py":
            assert cmd[-1] == "--tiled"        # the words as the end-to-end session holds them (mxfp4_tiles_bits)
            rows = [row(v, b, *times[v, b], 0.0 if v in (base, ring, wide) else 2 ** -7)
                    for b in map(int, arg["--batches"].split(",")) for v in arg["--variants"].split(";")
                    if (v, b) in times]
            os.makedirs(arg["--out"])
            with open(os.path.join(arg["--out"], "mx_tma_probe.json"), "w") as f:
                json.dump({"rows": rows}, f)
        elif script == "bench_e2e.py":
            os.makedirs(arg["--out"])
            with open(os.path.join(arg["--out"], "bench_e2e_mxfp4.json"), "w") as f:
                json.dump({"expert_read_tbps": {"B1": 3.36, "B16": 2.94}}, f)
        return 0, 1.0

    copies = []
    monkeypatch.setattr(mx_round, "run", fake_run)
    monkeypatch.setattr(mx_round, "prepare_copy", lambda scratch, *cfgs: copies.append(cfgs) or (scratch, {}))
    monkeypatch.setattr(mx_round.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx_round.torch.cuda, "get_device_name", lambda: "NVIDIA H200 (stand-in)")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["mx_round.py", "--out", str(out), "--scratch", str(tmp_path / "copy"),
                                      "--variants", ";".join((reg, ring, wide))])
    mx_round.main()
    res = json.loads((out / "mx_round.json").read_text())
    assert [c[0] for c in calls] == ["mx_tma_probe.py", "mx_tma_probe.py", "bench_e2e.py", "pytest"]
    assert calls[0][1] == pytest.approx(0.45 * 570) and calls[1][1] <= 0.12 * 570
    assert res["default"] == {"1": base} and res["variants"][:2] == [base, reg]
    assert res["mixes"] == {"1": mix}
    assert res["winners"] == {"1": mix}
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    assert copies == [(mx_round.variant_config(mix), mx_default_config(16 * 16, 32, 122))]
    assert res["expert_read_frac"] == {"B1": pytest.approx(0.8), "B16": pytest.approx(0.7)}
    assert set(res["phases"]) == {"probe", "probe_mix", "e2e", "tests"}
