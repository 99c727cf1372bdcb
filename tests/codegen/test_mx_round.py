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
    assert mx_round.choose(rows + [row(k128, 1, 40, 20, 0.1)], 1, a) == b


def test_default_variant_is_the_launchers_decode_default():
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    # mx27's default: 8-token tiles of 32 rows on a 2-stage TMA ring, the up kernel's activations carried one
    # tile ahead, the down kernel's loaded at use and capped at 80 registers
    assert mx_round.default_variant() == "8,32,2,1,0,0,80"
    assert mx_round.variant_config("8,32,2,1,0,0,80")[:7] == mx_default_config(16, 32, 122)
    assert mx_round.variant_config("8,32,2,2,2,80,80") == (8, 32, 256, 2, 2, False, (80, 80), (2, 2))
    assert mx_round.variant_config("8,32,1,2,2,80,0,128") == (8, 32, 128, 2, 1, False, (80, None), (2, 2))
    for bad in ("8,32,2,3,0,0,80", "8,32,2,1,0,0,80,64", "8,32,2,1,0,0", "8,32,2,1,0,0,80,256,1", "8,x,2,1,0,0,80",
                "8,64,2,1,0,0,80"):                                   # the last: 32 weight rows a warp
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
        # two multiplies (scale bytes above 128) and prefill keep their configurations
        for rows, scale_max in ((16, 255), (4096, 122)):
            assert module.mx_default_config(rows, 32, scale_max) == mx_default_config(rows, 32, scale_max)
    with pytest.raises(ValueError, match="not found exactly once"):
        mx_round.patched_default(source.replace("if not two and rows < 16 * E:", "if rows < 16 * E:"), small, small)


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
