"""One device call's MXFP4 decode round (H200): time candidate kernel variants, run the end-to-end benchmark under
the fastest, check the Gluon kernels against the Triton ones. Made for a device budget that may allow one call a
session: every phase has a wall-clock share, and what finished is written before the next starts.

1. `probe`: benchmarks/mx_tma_probe.py --tiled (the words in `mxfp4_tiles_bits`, as the end-to-end session holds
   them: k3c.runtime.layouts) over --variants (its 'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK]'
   form, BR, STAGES and BK each one value or 'UP/DOWN'; checked before any GPU work) at the end-to-end
   benchmark's expert count (32) and decode batches 1 and 16 where the launcher's default there is the `mma.sync`
   Gluon kernels (batch 1; batch 16 of 32 experts, 8 rows an expert, takes the `wgmma` kernels since run S,
   which benchmarks/bench_mx_wgmma.py times). The launcher's defaults at those batches on this card (one variant
   or two: `default_variant`; a card may have its own, `MX_DECODE_BY_DEVICE`) are always among them.
2. `probe_mix`: the up and down kernels are separate launches whose fields are their own (`mx_kernels`), so the
   fastest up kernel of one variant may join the fastest down kernel of another (`best_mix`, same token tile).
   Where that sum beats every timed variant by 1 %, the mix is timed itself, beside the defaults, in a second
   probe.
3. `choose`: per batch, the variant with the least up + down kernel time among those that agree with that batch's
   default (bitwise; within bf16 rounding for another K tile, which sums in another order), if it beats its
   time by at least 2 % (run-to-run noise: the end-to-end run that follows has no default beside it); 16-token
   tiles are timed at batch 16 only.
4. `e2e`: benchmarks/bench_e2e.py --experts mxfp4 (decode phases only) from this checkout when each batch's default wins
   there, else from a copy under --scratch whose `mx_default_config` returns the winners for the decode
   case on every card, batch 1's below 4 rows per expert and batch 16's from there (`patched_default`; 32
   experts: 0.5 and 8 rows per expert): the artifact's emitted `moe_experts` module carries that source, so the
   copy's artifact runs them. Before the run, a process with the run's environment confirms it imports the copy
   and sees the winners. The checkout itself is never modified.
5. `tests`: the GPU tests of the Gluon kernels (`pytest -m gpu tests/codegen/test_moe_mxfp4.py -k gluon_matches`).

    python3 benchmarks/mx_round.py --out DIR [--variants "...;..."] [--budget 570] [--skip tests,e2e]
Writes DIR/mx_round.json (the device; per phase: seconds, return code; the probes' table, the mixes timed, the
winner per batch and its mx_config, the end-to-end expert read rate at batch 1 and 16 as a fraction of 4.2 TB/s,
the H200's: on another GPU the fractions only compare the variants) beside each phase's own output.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from k3c.codegen.triton.moe_mxfp4 import mx_block_k, mx_default_config, mx_kernels  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import gl_act_ahead, gluon_decode_ok  # noqa: E402
from mx_tma_probe import parse_variant  # noqa: E402

HBM = 4.2e12
E, K = 32, 16                   # bench_e2e's routed experts and experts per token
D, I = 3584, 3072               # K3.1 Pro's expert shapes (bench_e2e's full widths)
BATCHES = (1, 16)
MARGIN = 0.02                   # how much faster than the default a winner must be
#: candidates after mx27 (benchmarks/mx_static_cost.py, Triton 3.6, BENCHMARKS.md "MXFP4 round (mx28)"): mx27 ran
#: the schedulers about half the time (latency-bound, 4 warps each), so more resident warps at about the same
#: instructions: the activations' unrolled prefetch (mode 2: the up kernel's 256 of K in 622 instructions against
#: 711), register caps (80: 12 CTAs an SM, one wave at batch 1), 128-wide K tiles (64 registers, 16 CTAs an SM, for
#: 680-724 instructions; the register word stream has no CTA barriers), 1-warp CTAs; at batch 16, 16-token tiles
#: (32 tiles of 32 experts against 43 of 8 tokens), among them mx29's ring of 128-wide K tiles (down: 72 registers,
#: 14 CTAs an SM) and the register stream capped at 88 (the default 8-token tile's instructions per weight at 11
#: CTAs an SM against 8)
VARIANTS = ("8,32,2,2,0,0,80;8,32,2,2,0,80,80;8,32,2,2,2,80,80;8,32,2,1,0,80,80;8,32,1,2,2,80,80;"
            "8,32,2,2,0,80,80,128;8,32,2,2,2,72,72,128;8,32,1,2,2,80,80,128;8,32,1,2,2,64,64,128;"
            "8,32,2,0,0,64,64,128;8,32,2,2,2,64,64,128;8,16,1,2,2,64,64,128;"
            "16,32,2,0,0,128,80;16,32,1,2,2,128,96;16,32,1,2,2,80,80,128;16,32,1,2,2,96,96,128;"
            "16,32,2,0,0,80,80,128;16,32,1,2,2,88,88,128")
E2E_SKIP = "finalize,first_logits,long,eager,torch_compile,bf16_build,numerics"
DEFAULT_RETURN = re.compile(r"(    if not two and rows < 16 \* E:\n)((?:        .*\n)+)")     # the decode case's body
DEVICE_LOOKUP = "MX_DECODE_BY_DEVICE.get(device)"      # mx_default_config's per-card table, bypassed in the copy


def kernel_fields(spec):
    """(BM, up, down) of a probe variant's text: each kernel's (BR, STAGES, ACT, CAP, BK), CAP 0 for none.
    Raises ValueError naming the text (mx_tma_probe.py's `parse_variant`), or one ending in ',t' or ',tb': the
    round times every variant over the words as a session holds them, `mxfp4_tiles_bits` (`probe`)."""
    v = parse_variant(spec)[1]
    if v["tiled"]:
        raise ValueError(f"variant {spec!r}: the round times every variant over the words as a session holds them; "
                         "drop the layout suffix")
    return v["block_m"], *((v["block_r"][j], v["stages"][j], v["act_" + k], v["cap_" + k], v["block_k"][j])
                           for j, k in enumerate(("up", "down")))


def variant_text(bm, up, down):
    """The probe variant text of `kernel_fields`' (BM, up, down): a field shared by the kernels written once."""
    def pair(a, b):
        return str(a) if a == b else f"{a}/{b}"

    (br1, s1, a1, c1, bk1), (br2, s2, a2, c2, bk2) = up, down
    bk = pair(bk1, bk2)
    return f"{bm},{pair(br1, br2)},{pair(s1, s2)},{a1},{a2},{c1},{c2}" + ("" if bk == "256" else f",{bk}")


def this_card():
    """The CUDA device's name (`torch.cuda.get_device_name`, what `launch_moe_experts` keys its decode configs by),
    None without a GPU."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def default_variant(batch, device=None):
    """The probe variant text of the launcher's decode default at `batch` tokens over E experts (one multiply) on
    the CUDA device named `device` (`mx_default_config`: a card may have its own; None: any); None where that
    default is not the `mma.sync` Gluon kernels this round probes (from 8 rows per expert: the `wgmma` kernels,
    benchmarks/bench_mx_wgmma.py)."""
    cfg = mx_default_config(batch * K, E, 122, device)
    (_, most1, *_), (_, most2, *_) = mx_kernels(cfg)
    if not gluon_decode_ok(cfg, D, I, mx_block_k(D, most1), mx_block_k(I, most2)):
        return None
    (br1, bk1, _, s1, c1), (br2, bk2, _, s2, c2) = mx_kernels(cfg)
    a1, a2 = gl_act_ahead(cfg)
    return variant_text(cfg[0], (br1, s1, a1, c1 or 0, bk1), (br2, s2, a2, c2 or 0, bk2))


def variant_config(spec):
    """Probe variant text (mx_tma_probe.py's `parse_variant`: 'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK]',
    BR, STAGES and BK each one value or 'UP/DOWN') -> the mx_config tuple the launcher takes (one multiply; a
    field the kernels share is one value, else an (up, down) pair: `mx_kernels`). Raises ValueError naming the
    text for anything else, or for a configuration the Gluon kernels refuse at K3.1 Pro's shapes
    (`gluon_decode_ok`)."""
    bm, up, down = kernel_fields(spec)

    def one(j, f=int):
        a, b = f(up[j]), f(down[j])
        return a if a == b else (a, b)

    cfg = (bm, one(0), one(4), one(0, lambda br: br // 16), one(1), False, (up[3] or None, down[3] or None),
           (up[2], down[2]))
    (_, most1, *_), (_, most2, *_) = mx_kernels(cfg)
    if not gluon_decode_ok(cfg, D, I, mx_block_k(D, most1), mx_block_k(I, most2)):
        raise ValueError(f"variant {spec!r}: the Gluon decode kernels do not take {cfg} (gluon_decode_ok)")
    return cfg


def agreeing(rows, batch, base):
    """{variant: (up us, down us)} of the rows at `batch` without an error that agree with the default output:
    bitwise where the variant's K tiles are the default variant `base`'s, else within 1/64 of the default
    output's largest magnitude (`ref_max_abs`: a few bf16 roundings; another K tile sums in another order). A
    variant timed twice (a second probe) keeps its last row."""
    def k_tiles(spec):
        _, up, down = kernel_fields(spec)
        return up[4], down[4]

    def agrees(r):
        if k_tiles(r["variant"]) == k_tiles(base):
            return r["max_abs_diff"] == 0
        return r["max_abs_diff"] <= r.get("ref_max_abs", 0) / 64

    return {r["variant"]: (r["up_us"], r["down_us"]) for r in rows
            if r["N"] == batch and not r.get("error") and agrees(r)}


def choose(rows, batch, base, margin=MARGIN):
    """The variant (text) to run at `batch`: the fastest (up + down time) of `agreeing`'s, if it beats `base`'s
    time there by `margin`; else `base`."""
    ok = {v: sum(t) for v, t in agreeing(rows, batch, base).items()}
    if not ok:
        return base
    best = min(ok, key=ok.get)
    return best if base not in ok or ok[best] <= (1 - margin) * ok[base] else base


def best_mix(rows, batch, base, gain=MARGIN / 2):
    """A variant not yet timed that joins the fastest agreeing up kernel to the fastest agreeing down kernel of
    the same token tile (the two are separate launches: each kernel's fields are its own, `mx_kernels`), if the
    sum of their times beats every timed variant at `batch` by `gain`; else None. The mix is a prediction: it
    wins only once timed itself (`choose`). Every check of `gluon_decode_ok` is per kernel, so the mix of two
    variants it takes is one it takes."""
    ok = agreeing(rows, batch, base)
    if not ok:
        return None
    mixes = {}
    for bm in {kernel_fields(v)[0] for v in ok}:
        same = [v for v in ok if kernel_fields(v)[0] == bm]
        up_v, down_v = min(same, key=lambda v: ok[v][0]), min(same, key=lambda v: ok[v][1])
        mixes[variant_text(bm, kernel_fields(up_v)[1], kernel_fields(down_v)[2])] = ok[up_v][0] + ok[down_v][1]
    mix = min(mixes, key=mixes.get)
    return None if mix in ok or mixes[mix] > (1 - gain) * min(map(sum, ok.values())) else mix


def patched_default(source, small, large):
    """moe_mxfp4.py's `source` with `mx_default_config`'s decode case (one multiply, < 16 rows per expert)
    returning the mx_config `small` below 4 rows per expert and `large` from there on every card (one return when
    they are the same; their two_muls field stays the function's `two`; the per-card table `MX_DECODE_BY_DEVICE`
    is no longer looked up). Raises ValueError if the decode case or the table's lookup is not found exactly
    once."""
    if len(DEFAULT_RETURN.findall(source)) != 1:
        raise ValueError("moe_mxfp4.py: mx_default_config's decode case not found exactly once")
    if source.count(DEVICE_LOOKUP) != 1:
        raise ValueError(f"moe_mxfp4.py: mx_default_config's {DEVICE_LOOKUP} not found exactly once")
    source = source.replace(DEVICE_LOOKUP, "None")

    def text(config):
        return "(" + ", ".join("two" if i == 5 else repr(v) for i, v in enumerate(config)) + ")"

    ret = text(small) if small == large else f"{text(small)} if rows < 4 * E else {text(large)}"
    return DEFAULT_RETURN.sub(lambda m: m.group(1) + "        return " + ret + "\n", source)


def run(cmd, seconds, log, cwd=ROOT, env=None):
    """`cmd` with a wall-clock limit, its output into `log`: (return code or 'timeout', seconds taken). It runs in
    a session of its own, so a timeout kills its whole process group (the probe's compile workers too)."""
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "timeout"
    return rc, round(time.time() - t0, 1)


def prepare_copy(scratch, small, large):
    """A copy of the checkout at `scratch` whose `mx_default_config` returns `small` / `large` (`patched_default`)
    and the environment that imports k3c from it: (cwd, env). Raises RuntimeError if a process with that
    environment does not import the copy or does not see the winners."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(ROOT, scratch, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".gpu_*"))
    path = os.path.join(scratch, "k3c", "codegen", "triton", "moe_mxfp4.py")
    with open(path) as f:
        source = f.read()
    with open(path, "w") as f:
        f.write(patched_default(source, small, large))
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(":") if p and os.path.realpath(p) != ROOT]
    env["PYTHONPATH"] = ":".join([scratch] + keep)
    device = this_card()                   # as the run's launches see it
    probe = ("import json, k3c; from k3c.codegen.triton.moe_mxfp4 import mx_default_config as f; "
             f"print(json.dumps([k3c.__file__, f({K}, {E}, 122, {device!r}), f({16 * K}, {E}, 122, {device!r})]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=scratch, env=env, capture_output=True, text=True)
    seen = json.loads(out.stdout) if out.returncode == 0 else None
    want = json.loads(json.dumps([small, large]))
    if not seen or not os.path.realpath(seen[0]).startswith(os.path.realpath(scratch) + os.sep) or seen[1:] != want:
        raise RuntimeError(f"the copy at {scratch} is not what a run imports: {seen or out.stderr[-500:]}")
    return scratch, env


def run_e2e(out, seconds, cwd, env):
    """benchmarks/bench_e2e.py --experts mxfp4 (decode phases: E2E_SKIP) from the checkout `cwd` with `env`, its
    output under OUT/e2e, its log OUT/e2e.log: (`run`'s (return code, seconds), the expert read rate at batch 1
    and 16 as fractions of HBM, None if it wrote none)."""
    e2e_out = os.path.join(out, "e2e")
    phase = run([sys.executable, "benchmarks/bench_e2e.py", "--out", e2e_out, "--experts", "mxfp4", "--skip",
                 E2E_SKIP], seconds, os.path.join(out, "e2e.log"), cwd, env)
    try:
        with open(os.path.join(e2e_out, "bench_e2e_mxfp4.json")) as f:
            rates = json.load(f).get("expert_read_tbps", {})
        return phase, {b: v * 1e12 / HBM if v else None for b, v in rates.items()}
    except (OSError, ValueError):
        return phase, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=VARIANTS,
                    help="';'-separated probe variants 'BM,BR,STAGES,ACT_UP,ACT_DOWN,CAP_UP,CAP_DOWN[,BK]'")
    ap.add_argument("--budget", type=float, default=570, help="seconds for the whole round")
    ap.add_argument("--scratch", default="/tmp/k3c_mx_round",
                    help="where a patched copy of the checkout goes (outside it; replaced)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: e2e, tests")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if skip - {"e2e", "tests"}:
        ap.error(f"--skip {a.skip!r}: phases are e2e, tests")
    out, scratch = os.path.realpath(a.out), os.path.realpath(a.scratch)
    if os.path.commonpath([scratch, ROOT]) in (scratch, ROOT):       # the checkout, above it or inside it
        ap.error(f"--scratch {a.scratch!r}: must lie outside the checkout {ROOT} (it is replaced by a copy)")
    base = {b: v for b in BATCHES if (v := default_variant(b, this_card()))}     # the batches it can probe
    defaults = list(dict.fromkeys(base.values()))
    specs = defaults + [v for v in a.variants.split(";") if v and v not in defaults]
    for spec in specs:
        try:
            variant_config(spec)
        except ValueError as err:
            ap.error(f"--variants: {err}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Gluon kernels have no interpreter)")
    t_end = time.time() + a.budget
    os.makedirs(out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "default": base, "variants": specs, "phases": {}}

    def save():
        with open(os.path.join(out, "mx_round.json"), "w") as f:
            json.dump(res, f, indent=1)

    alone = skip >= {"e2e", "tests"}

    def probe(name, variants, batches, seconds):
        """mx_tma_probe.py over `variants` at `batches` into OUT/name: its rows (none if it failed)."""
        res["phases"][name] = run([sys.executable, "benchmarks/mx_tma_probe.py", "--out", os.path.join(out, name),
                                   "--experts", str(E), "--batches", ",".join(map(str, batches)), "--variants",
                                   ";".join(variants), "--tiled"], seconds, os.path.join(out, f"{name}.log"))
        try:
            with open(os.path.join(out, name, "mx_tma_probe.json")) as f:
                return json.load(f)["rows"]
        except (OSError, ValueError, KeyError):
            return []

    rows = probe("probe", specs, list(base), (0.85 if alone else 0.45) * a.budget)
    mixes = {b: best_mix(rows, b, base[b]) for b in base}
    todo = sorted({m for m in mixes.values() if m})
    if todo:        # time the mixes beside the defaults in one process; their rows and the defaults' come last
        res["mixes"] = mixes
        rows += probe("probe_mix", defaults + todo, [b for b in base if mixes[b]],
                      t_end - time.time() if alone else min(0.12 * a.budget, t_end - time.time()))
    res["probe"] = [{k: r.get(k) for k in ("N", "variant", "max_abs_diff", "ref_max_abs", "up_us", "down_us",
                                           "kernels_frac", "error")} for r in rows]
    winners = {b: choose(rows, b, base[b]) for b in base}
    res["winners"] = winners
    res["winner_configs"] = {b: list(variant_config(v)) for b, v in winners.items()}
    save()
    print(f"probe: {len(rows)} rows, default {base}, mixes {todo}, winners {winners}", flush=True)

    if "e2e" not in skip:
        cwd, env = ROOT, None
        try:
            if winners != base:
                cwd, env = prepare_copy(scratch, *(variant_config(winners[b]) if b in winners else
                                                   mx_default_config(b * K, E, 122) for b in BATCHES))
        except (OSError, ValueError, RuntimeError) as err:
            res["phases"]["e2e"] = f"not run: {type(err).__name__}: {err}"
            cwd = None
        if cwd:
            left = t_end - time.time() - (0 if "tests" in skip else 0.15 * a.budget)
            res["phases"]["e2e"], res["expert_read_frac"] = run_e2e(out, left, cwd, env)
            res["e2e_config"] = "default" if cwd == ROOT else winners
            print(f"e2e ({res['e2e_config']}): expert read {res['expert_read_frac']}", flush=True)
        save()

    if "tests" not in skip:
        res["phases"]["tests"] = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                                      "tests/codegen/test_moe_mxfp4.py", "-k", "gluon_matches"],
                                     t_end - time.time(), os.path.join(out, "tests.log"))
        save()
    print(json.dumps(res["phases"]), flush=True)


if __name__ == "__main__":
    main()
