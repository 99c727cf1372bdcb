"""One device call's MXFP4 decode round (H200): time candidate kernel variants, run the end-to-end benchmark under
the fastest, check the Gluon kernels against the Triton ones. Made for a device budget that may allow one call a
session: every phase has a wall-clock share, and what finished is written before the next starts.

1. `probe`: benchmarks/mx_tma_probe.py over --variants (its 'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN' form) at
   the end-to-end benchmark's expert count (32) and decode batches 1 and 16. The launcher's default for that
   shape is always among them.
2. `choose`: per batch, the variant with the least up + down kernel time among those that agree with the default
   (bitwise; within bf16 rounding for another K tile, which sums in another order); 16-token tiles are timed at
   batch 16 only.
3. `e2e`: benchmarks/bench_e2e.py --experts mxfp4 (decode phases only) from this checkout when the default wins at
   both batches, else from a copy under --scratch whose `mx_default_config` returns the winners for the decode
   case, batch 1's below 4 rows per expert and batch 16's from there (`patched_default`; 32 experts: 0.5 and 8
   rows per expert): the artifact's emitted `moe_experts` module carries that source, so the copy's artifact runs
   them. The checkout itself is never modified.
4. `tests`: the GPU tests of the Gluon kernels (`pytest -m gpu tests/codegen/test_moe_mxfp4.py -k gluon_matches`).

    python3 benchmarks/mx_round.py --out DIR [--variants "...;..."] [--budget 570] [--skip tests,e2e]
Writes DIR/mx_round.json (per phase: seconds, return code; the probe's table, the winner per batch and its
mx_config, the end-to-end expert read rate at batch 1 and 16 as a fraction of 4.2 TB/s) beside each phase's own
output.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
from k3c.codegen.triton.moe_mxfp4 import mx_default_config  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import gl_act_ahead  # noqa: E402

HBM = 4.2e12
E, K = 32, 16                   # bench_e2e's routed experts and experts per token
BATCHES = (1, 16)
#: candidates after mx27 (benchmarks/mx_static_cost.py, Triton 3.6, BENCHMARKS.md "MXFP4 round (mx28)"): mx27 ran
#: the schedulers about half the time (latency-bound, 4 warps each), so more resident warps at about the same
#: instructions: the activations' unrolled prefetch (mode 2: the up kernel's 256 of K in 622 instructions against
#: 711), register caps (80: 12 CTAs an SM, one wave at batch 1), 128-wide K tiles (64 registers, 16 CTAs an SM, for
#: 680-724 instructions; the register word stream has no CTA barriers), 1-warp CTAs; at batch 16, 16-token tiles
#: (32 tiles of 32 experts against 43 of 8 tokens)
VARIANTS = ("8,32,2,2,0,0,80;8,32,2,2,0,80,80;8,32,2,2,2,80,80;8,32,2,1,0,80,80;8,32,1,2,2,80,80;"
            "8,32,2,2,0,80,80,128;8,32,2,2,2,72,72,128;8,32,1,2,2,80,80,128;8,32,1,2,2,64,64,128;"
            "8,32,2,0,0,64,64,128;8,32,2,2,2,64,64,128;8,16,1,2,2,64,64,128;"
            "16,32,2,0,0,128,80;16,32,1,2,2,128,96;16,32,1,2,2,80,80,128;16,32,1,2,2,96,96,128")
E2E_SKIP = "finalize,first_logits,long,eager,torch_compile,bf16_build,numerics"
DEFAULT_RETURN = re.compile(r"(    if not two and rows < 16 \* E:\n        return )(\(.*\))\n")


def default_variant():
    """The probe variant text of the launcher's decode default at batch 1 of E experts (one multiply)."""
    bm, br, _, _, stages, _, caps = mx_default_config(K, E, 122)[:7]
    up, down = gl_act_ahead(mx_default_config(K, E, 122))
    cap_up, cap_down = caps if isinstance(caps, tuple) else (caps, caps)
    return f"{bm},{br},{stages},{up},{down},{cap_up or 0},{cap_down or 0}"


def variant_config(spec):
    """Probe variant text (mx_tma_probe.py's 'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK]') -> the mx_config
    tuple the launcher takes (one multiply; K tiles of BK, default 256)."""
    f = list(map(int, spec.split(",")))
    bm, br, stages, up, down, cap_up, cap_down = f[:7]
    return (bm, br, f[7] if len(f) > 7 else 256, br // 16, stages, False, (cap_up or None, cap_down or None),
            (up, down))


def choose(rows, batch, default_bk=256):
    """The variant (text) with the least up + down time at `batch` among the rows without an error that agree
    with the default: bitwise (max_abs_diff 0) where the variant's K tile is the default's `default_bk`, else
    within 1/64 of the default output's largest magnitude (`ref_max_abs`: a few bf16 roundings; another K tile
    sums in another order). None if there is none."""
    def agrees(r):
        same_order = variant_config(r["variant"])[2] == default_bk
        return r["max_abs_diff"] == 0 if same_order else r["max_abs_diff"] <= r.get("ref_max_abs", 0) / 64

    ok = {r["variant"]: r["up_us"] + r["down_us"] for r in rows if r["N"] == batch and "error" not in r and agrees(r)}
    return min(ok, key=ok.get) if ok else None


def patched_default(source, small, large):
    """moe_mxfp4.py's `source` with `mx_default_config`'s decode case (one multiply, < 16 rows per expert)
    returning the mx_config `small` below 4 rows per expert and `large` from there (one return when they are the
    same; their two_muls field stays the function's `two`). Raises ValueError if that line is not found exactly
    once."""
    if len(DEFAULT_RETURN.findall(source)) != 1:
        raise ValueError("moe_mxfp4.py: mx_default_config's decode return line not found exactly once")

    def text(config):
        return "(" + ", ".join("two" if i == 5 else repr(v) for i, v in enumerate(config)) + ")"

    ret = text(small) if small == large else f"{text(small)} if rows < 4 * E else {text(large)}"
    return DEFAULT_RETURN.sub(lambda m: m.group(1) + ret + "\n", source)


def run(cmd, seconds, log, cwd=ROOT, env=None):
    """`cmd` with a wall-clock limit, its output into `log`: (return code or 'timeout', seconds taken)."""
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=max(seconds, 1)
                                ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, round(time.time() - t0, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=VARIANTS, help="';'-separated probe variants (mx_tma_probe.py's form)")
    ap.add_argument("--budget", type=float, default=570, help="seconds for the whole round")
    ap.add_argument("--scratch", default="/tmp/k3c_mx_round", help="where a patched copy of the checkout goes")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: e2e, tests")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if skip - {"e2e", "tests"}:
        ap.error(f"--skip {a.skip!r}: phases are e2e, tests")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels have no interpreter)")
    base = default_variant()
    specs = [base] + [v for v in a.variants.split(";") if v and v != base]
    t_end = time.time() + a.budget
    os.makedirs(a.out, exist_ok=True)
    res = {"default": base, "variants": specs, "phases": {}}

    def save():
        with open(os.path.join(a.out, "mx_round.json"), "w") as f:
            json.dump(res, f, indent=1)

    probe_out = os.path.join(a.out, "probe")
    alone = skip >= {"e2e", "tests"}
    res["phases"]["probe"] = run([sys.executable, "benchmarks/mx_tma_probe.py", "--out", probe_out, "--experts",
                                  str(E), "--batches", ",".join(map(str, BATCHES)), "--variants", ";".join(specs)],
                                 t_end - time.time() if alone else 0.45 * a.budget, os.path.join(a.out, "probe.log"))
    try:
        with open(os.path.join(probe_out, "mx_tma_probe.json")) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        rows = []
    res["probe"] = [{k: r.get(k) for k in ("N", "variant", "max_abs_diff", "ref_max_abs", "up_us", "down_us",
                                           "kernels_frac", "error")} for r in rows]
    winners = {b: choose(rows, b) or base for b in BATCHES}
    res["winners"] = winners
    res["winner_configs"] = {b: list(variant_config(v)) for b, v in winners.items()}
    save()
    print(f"probe: {len(rows)} rows, default {base}, winners {winners}", flush=True)

    if "e2e" not in skip:
        cwd, env = ROOT, dict(os.environ)
        if set(winners.values()) != {base}:
            cwd = a.scratch
            shutil.rmtree(cwd, ignore_errors=True)
            shutil.copytree(ROOT, cwd, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".gpu_*"))
            path = os.path.join(cwd, "k3c", "codegen", "triton", "moe_mxfp4.py")
            with open(path) as f:
                source = f.read()
            with open(path, "w") as f:
                f.write(patched_default(source, *(variant_config(winners[b]) for b in BATCHES)))
            keep = [p for p in env.get("PYTHONPATH", "").split(":") if p and os.path.abspath(p) != ROOT]
            env["PYTHONPATH"] = ":".join(keep + [cwd])
        e2e_out = os.path.join(a.out, "e2e")
        left = t_end - time.time() - (0 if "tests" in skip else 0.15 * a.budget)
        res["phases"]["e2e"] = run([sys.executable, "benchmarks/bench_e2e.py", "--out", e2e_out, "--experts",
                                    "mxfp4", "--skip", E2E_SKIP], left, os.path.join(a.out, "e2e.log"), cwd, env)
        res["e2e_config"] = "default" if cwd == ROOT else winners
        try:
            with open(os.path.join(e2e_out, "bench_e2e_mxfp4.json")) as f:
                rates = json.load(f).get("expert_read_tbps", {})
            res["expert_read_frac"] = {b: v * 1e12 / HBM if v else None for b, v in rates.items()}
        except (OSError, ValueError):
            res["expert_read_frac"] = None
        save()
        print(f"e2e ({res['e2e_config']}): expert read {res['expert_read_frac']}", flush=True)

    if "tests" not in skip:
        res["phases"]["tests"] = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                                      "tests/codegen/test_moe_mxfp4.py", "-k", "gluon_matches"],
                                     t_end - time.time(), os.path.join(a.out, "tests.log"))
        save()
    print(json.dumps(res["phases"]), flush=True)


if __name__ == "__main__":
    main()
