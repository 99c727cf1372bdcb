"""Probe (H200, H100) of the CTA barriers Triton 3.6 places in the ring refills of the one-launch MXFP4 kernel
(`moe_mx_wgmma_fused_kernel`, k3c.codegen.triton.moe_mxfp4_fused): the same kernel with some of them removed from
its PTX, timed beside the library's.

Gluon's TMA copy lowers to `bar.sync 0` (a CTA barrier), an elected thread's `cp.async.bulk.tensor`, so a stage's
three copies (w1, w3, activations; two in the down phase) are three barriers, after the one before the expect and
the refill's proxy fence; Triton's shared-memory hazard analysis adds one between a K tile's pieces (the TMA writes
to a ring stage it cannot tell apart from the one read next). Variants, by PTX text edit (`drop_barriers`), each
compiled through Triton's `ir_override` option (the PTX stage replaced, the rest of the pipeline as the launch's):
- native: the launch as the library makes it;
- base: the library's own PTX through `ir_override` (the override path's own effect);
- copies: without the barriers between two copies of a stage (the barrier before the first copy kept: every
  warp's reads of the stage before one thread overwrites it);
- copies+mid: also without the hazard barrier between a K tile's pieces (the stage read was waited for on its
  mbarrier).
Each case: `launch_moe_experts` (gather, one-launch kernel, slot sum; a precomputed schedule) on random MXFP4
experts in the runtime's `mxfp4_tiles_bits` layout, K3.1 Pro's expert shapes (D 3584, I 3072, top-16), 8 tokens
an expert (N = E / 2 tokens). Outputs compared bitwise with the native launch; times are medians over rounds of
`do_bench_cudagraph`, the variants alternated (reversed every other round).

    python3 benchmarks/mx_refill_barriers.py --out DIR [--experts 32,16,64] [--rounds 6]

Writes DIR/mx_refill_barriers.json. Raw results: benchmarks/results_mx_run_ab_barriers_h200.json (BENCHMARKS.md
"MXFP4 round, run AB").
"""

import argparse
import json
import os
import re
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_moe_mxfp4 import ACT, D, I, K, mx_weights, routing  # noqa: E402

import k3c.codegen.triton.moe_mxfp4_fused as fused  # noqa: E402
from k3c.codegen.triton.moe import launch_moe_experts, moe_schedule  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mx_default_config  # noqa: E402
from k3c.runtime.layouts import mx_tile_bits  # noqa: E402

#: the PTX instructions that order or touch memory, for deciding what a barrier sits between
_ORDERED = re.compile(r"(bar\.sync|cp\.async\.bulk|fence\.proxy|mbarrier\.|ld\.shared|st\.shared|wgmma\.|ld\.global|"
                      r"st\.global|atom\.|red\.|mul\.bf16x2)")
VARIANTS = {"base": (False, False), "copies": (True, False), "copies+mid": (True, True)}


def drop_barriers(ptx: str, copies: bool, mid: bool) -> tuple[str, int]:
    """(ptx without the chosen `bar.sync` lines, how many were dropped). copies: a barrier whose nearest ordered
    instructions (`_ORDERED`) before and after are both TMA copies; mid: one after a piece's decoding (its last
    `mul.bf16x2`) and before a shared-memory read or a `wgmma`."""
    lines = ptx.splitlines()
    code = [(i, s.strip()) for i, s in enumerate(lines) if s.strip() and not s.strip().startswith(("//", ".loc", "$L"))]
    drop = set()
    for k, (i, s) in enumerate(code):
        if not s.startswith("bar.sync"):
            continue
        before = next((m.group(1) for _, x in reversed(code[:k]) if (m := _ORDERED.search(x))), None)
        after = next((m.group(1) for _, x in code[k + 1:] if (m := _ORDERED.search(x))), None)
        if (copies and before == after == "cp.async.bulk") or \
                (mid and before == "mul.bf16x2" and after in ("wgmma.", "ld.shared")):
            drop.add(i)
    return "\n".join(s for i, s in enumerate(lines) if i not in drop) + "\n", len(drop)


class _Override:
    """Stands in for the kernel in k3c.codegen.triton.moe_mxfp4_fused: launches it with `ir_override` = path (None:
    as the library does) and keeps the last launch's compiled kernel."""
    native = fused.moe_mx_wgmma_fused_kernel

    def __init__(self):
        self.path, self.last = None, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.native[grid](*args, **kwargs, **({"ir_override": self.path} if self.path else {}))
            return self.last
        return launch


def run_case(E, rounds, over, dev="cuda"):
    """The rows of one expert count (module docstring), or [] where the launch does not take the one-launch path."""
    gen = torch.Generator(device=dev).manual_seed(E)
    mx = [mx_weights(E, I, D, dev, gen), mx_weights(E, I, D, dev, gen), mx_weights(E, D, I, dev, gen)]
    ws = tuple(mx_tile_bits(w) for w, _ in mx) + tuple(s for _, s in mx)
    N = E // 2
    z = (torch.randn(N, D, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    ids, wt = routing(N, E, dev, gen)
    cfg = mx_default_config(N * K, E, 122, torch.cuda.get_device_name())
    sched = moe_schedule(ids, E, cfg[0])
    y = torch.empty_like(z)

    def run():
        launch_moe_experts(z, wt, ids, *ws, y=y, schedule=sched, scale_max=122, tiled=2, **ACT)

    over.path, over.last = None, None
    run()
    torch.cuda.synchronize()
    if over.last is None:
        print(f"E {E}: not the one-launch path ({cfg})", flush=True)
        return []
    ptx, paths, dropped = over.last.asm["ptx"], {"native": None}, {"native": 0}
    for tag, (copies, mid) in VARIANTS.items():
        text, dropped[tag] = drop_barriers(ptx, copies, mid)
        paths[tag] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mx_refill_{E}_{tag.replace('+', '_')}.ptx")
        with open(paths[tag], "w") as f:
            f.write(text)
    outs, regs = {}, {}
    for tag, path in paths.items():
        over.path = path
        y.zero_()
        run()
        torch.cuda.synchronize()
        outs[tag], regs[tag] = y.clone(), over.last.n_regs
    times = {tag: [] for tag in paths}
    for r in range(rounds):
        for tag in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            over.path = paths[tag]
            times[tag].append(triton.testing.do_bench_cudagraph(run, rep=100) * 1e3)
    base = statistics.median(times["native"])
    rows = []
    for tag in paths:
        med = statistics.median(times[tag])
        rows.append({"E": E, "N": N, "variant": tag, "barriers_dropped": dropped[tag], "registers": regs[tag],
                     "us_median": med, "us_all": times[tag], "vs_native": med / base - 1,
                     "bitwise_same": bool(torch.equal(outs[tag], outs["native"])), "config": [str(c) for c in cfg]})
        print(f"E {E} N {N} {tag:11s} dropped {dropped[tag]:3d}  {med:8.2f} us  {med / base - 1:+.2%}  "
              f"same {rows[-1]['bitwise_same']}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--experts", default="32,16,64", help="comma-separated expert counts (N = E / 2 tokens)")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    over = _Override()
    fused.moe_mx_wgmma_fused_kernel = over
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "rows": []}
    for E in map(int, a.experts.split(",")):
        res["rows"] += run_case(E, a.rounds, over)
        with open(os.path.join(a.out, "mx_refill_barriers.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
