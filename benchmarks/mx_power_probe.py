"""Probe (sm_90): how the `wgmma` MXFP4 decode kernels' sustained time, SM clock and board power depend on the
activations' values, at K3.1 Pro's expert shapes (latent D 3584, inner I 3072) over 32 random experts (as
bench_mx_wgmma.py draws them) with 8 tokens each in 16-row tiles (batch 16 of 32 experts choosing 16).

    python3 benchmarks/mx_power_probe.py --out DIR [--modes rand,pad0,all0,rand] [--settle 1.0]

Modes fill the tiles' activation rows (zs for the up kernel, h for the down kernel, written here directly, not
gathered): rand, the 8 token rows and the 8 padding rows random (as another expert's rows); pad0, the padding
rows zeros (what `wg_gather_kernel` and the up kernel write since run V); all0, every row zeros; bm8, pad0's 8
token rows an expert in 8-row tiles (`m64n8k16` `wgmma`s, no padding rows: BLOCK_M 8). Each kernel runs
back to back, --settle seconds to reach the card's power limit, then 3000 (up) / 6000 (down) launches timed with
CUDA events. `nvidia-smi` samples the SM clock and power every 100 ms meanwhile; the mean over each kernel's last
0.8 s is reported. BENCHMARKS.md "MXFP4 round, run V" (an H100: pad0 raises the clock under the up kernel from
1.56 to 1.63-1.69 GHz). Writes DIR/mx_power_probe.json.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from bench_mx_wgmma import case  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mx_default_config  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_fused import mx_wgmma_launches  # noqa: E402
from mx_tma_probe import ACT, D, I, K  # noqa: E402

E, T, TOKENS = 32, 16, 8


def smi_samples(path):
    """(unix time, SM MHz, W) of each line nvidia-smi wrote to `path`."""
    out = []
    for line in open(path).read().splitlines()[1:]:
        f = [x.strip() for x in line.split(",")]
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
        out.append((t.timestamp(), float(f[1].split()[0]), float(f[2].split()[0])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="rand,pad0,all0,rand")
    ap.add_argument("--settle", type=float, default=1.0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kop, _ = case(E, gen)
    cfg = mx_default_config(16 * K, E, 122, torch.cuda.get_device_name())
    tiles = torch.arange(E, device="cuda")
    sched = (torch.arange(E * T, device="cuda"), tiles, tiles * T, tiles * T + TOKENS)
    zs_r = (torch.randn(E * T, D, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    h_r = (torch.randn(E * T, I, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    wt = torch.rand(E * T, device="cuda", generator=gen)
    pad = (torch.arange(E * T, device="cuda") % T >= TOKENS)[:, None]
    log = os.path.join(a.out, "smi.csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv", "-lms",
                            "100"], stdout=open(log, "w"))
    rows, marks = [], []
    try:
        for mode in a.modes.split(","):
            zs, h, mcfg, msched, mwt = zs_r.clone(), h_r.clone(), cfg, sched, wt
            if mode == "bm8":                   # the same 8 token rows an expert in 8-row tiles: no padding rows
                zs = zs.view(E, T, D)[:, :TOKENS].reshape(E * TOKENS, D)
                h = h.view(E, T, I)[:, :TOKENS].reshape(E * TOKENS, I)
                mcfg, mwt = (TOKENS,) + tuple(cfg[1:]), wt[:E * TOKENS]
                msched = (torch.arange(E * TOKENS, device="cuda"), tiles, tiles * TOKENS, tiles * TOKENS + TOKENS)
            elif mode == "pad0":
                zs.masked_fill_(pad, 0)
                h.masked_fill_(pad, 0)
            elif mode == "all0":
                zs.zero_()
                h.zero_()
            elif mode != "rand":
                ap.error(f"--modes: {mode!r} is not rand, pad0, all0 or bm8")
            y_slot = torch.empty(E * T, D, dtype=torch.float32, device="cuda")
            h_out = torch.empty_like(h)
            _, up, _ = mx_wgmma_launches(zs, zs, msched, *kop.words, kop.s, h_out, y_slot, mwt, mx_config=mcfg, K=K,
                                         tiled=2, **ACT)
            _, _, down = mx_wgmma_launches(zs, zs, msched, *kop.words, kop.s, h, y_slot, mwt, mx_config=mcfg, K=K,
                                           tiled=2, **ACT)
            row = {"mode": mode}
            for name, fn, n in (("up", up, 3000), ("down", down, 6000)):
                fn()
                torch.cuda.synchronize()
                t0 = time.time()
                while time.time() - t0 < a.settle:
                    for _ in range(100):
                        fn()
                    torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(n):
                    fn()
                e1.record()
                torch.cuda.synchronize()
                row[f"{name}_us"] = e0.elapsed_time(e1) * 1e3 / n
                marks.append((time.time(), len(rows), name))
            rows.append(row)
            print(f"{mode:5s} up {row['up_us']:6.1f} us  down {row['down_us']:6.1f} us", flush=True)
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    samples = smi_samples(log)
    for t, i, name in marks:
        s = [x for x in samples if t - 0.8 <= x[0] <= t]
        if s:
            rows[i][f"{name}_sm_MHz"] = sum(x[1] for x in s) / len(s)
            rows[i][f"{name}_W"] = sum(x[2] for x in s) / len(s)
    res = {"device": torch.cuda.get_device_name(), "mx_config": repr(cfg), "rows": rows}
    with open(os.path.join(a.out, "mx_power_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r in rows:
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}, flush=True)


if __name__ == "__main__":
    main()
