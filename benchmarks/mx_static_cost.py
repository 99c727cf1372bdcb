"""Static cost of the MXFP4 decode kernels (k3c.codegen.triton.moe_mxfp4_gluon), compiled offline for the H200:
no GPU needed. For each mx_config it compiles the Gluon up / down kernels at K3.1 Pro's expert shapes for sm_90a
(k3c.codegen.triton.offline: `triton.compile` with an explicit `GPUTarget`, Triton's own ptxas and cuobjdump),
and reports:

- registers per thread, spilled bytes, shared memory per CTA (the launch's `maxnreg` applies);
- the SASS of the K loop (the kernel's one backward branch): instructions per iteration, per weight and per
  thread, and the count of global loads (`LDG`), cp.async copies (`LDGSTS`), TMA copies (`UTMALDG`), shared
  loads (`LDS`), barriers (`BAR`), `HMMA`s and moves (`MOV`, `IMAD.MOV`, `PRMT`);
- where in the loop body the first and last 16-byte global load (`LDG.E.128`) and TMA copy are issued
  (0 = the loop's top, 1 = its back branch): a "prefetch" issued at 0.75 is in flight for a quarter of an
  iteration;
- CTAs per SM by registers and shared memory (sm_90: 65,536 registers an SM, allocated per warp in units of
  256; 228 KB of shared memory an SM, 1 KB reserved per CTA; at most 32 CTAs and 64 warps; the CUDA occupancy
  calculator's rules) and, for each (experts, batch), the CTAs the two launches run under uniform random
  top-16 routing (seed 0, `moe_schedule`'s tiles × weight-row blocks) and the waves that makes on 132 SMs.

Run (CPU; the device's Triton for numbers that match it: `pip install --target /tmp/t36 triton==3.6.0`):
    PYTHONPATH=/tmp/t36 python benchmarks/mx_static_cost.py [--configs "8,32,256,2,1,0,0;..."]
        [--experts 32,896] [--batches 1,16] [--module ARTIFACT/kernels/kNNNN_moe_experts.py] [--out DIR]
        [--tiled 0|1|2]
Configs as `bench_moe_mxfp4.py --gluon-configs` (`mx_config_from_text`): BLOCK_M, BLOCK_R, BLOCK_K, warps,
stages (≥ 2: the TMA ring), two_muls (0/1), maxnreg (0: none) and optionally the activation prefetch modes
"UP/DOWN" (`gl_act_ahead`; 2 unrolls the K loop by two: the counts are then per K tile, half the body's, and the
load positions are over the whole two-tile body); BLOCK_R, BLOCK_K, warps, stages and maxnreg may be "UP/DOWN",
one value per kernel (`mx_kernels`). --module: compile the kernels of an emitted MXFP4 `moe_experts` module (what
an artifact runs) instead of k3c's. Writes OUT/mx_static_cost.json and prints a table. A config `gluon_decode_ok`
refuses is reported as such, not compiled.
"""

import argparse
import importlib.util
import json
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton.moe import moe_schedule  # noqa: E402
from k3c.codegen.triton.moe_mxfp4 import mx_block_k, mx_config_from_text, mx_kernels  # noqa: E402
from k3c.codegen.triton.gl_ring import gl_word_descs  # noqa: E402
from k3c.codegen.triton.moe_mxfp4_gluon import (  # noqa: E402
    gl_act_ahead,
    gluon_decode_ok,
    moe_down_mx_gluon_kernel,
    moe_up_mx_gluon_kernel,
)
from k3c.codegen.triton.offline import compile_for, resources, sass  # noqa: E402

D, I, K = 3584, 3072, 16       # K3.1 Pro: routed_expert_hidden_size, moe_intermediate_size, experts per token
SMS = 132                      # H200 streaming multiprocessors
SM_REGISTERS, SM_SHARED, CTA_RESERVED, SM_CTAS, SM_WARPS = 65536, 228 * 1024, 1024, 32, 64
DEFAULT_CONFIGS = "8,32,256,2,1,0,0;8,32,256,2,2,0,0/80;8,32,256,2,3,0,0;16,32,256,2,1,0,0;16,32,256,2,2,0,0"

#: pointer arguments' element types, by name (the rest of the arguments are fp32 scalars or constexprs)
POINTERS = {"zp_ptr": "*i32", "hp_ptr": "*i32", "w1": "*i32", "w3": "*i32", "w2": "*i32",
            "s1_ptr": "*u8", "s3_ptr": "*u8", "s2_ptr": "*u8", "order_ptr": "*i64", "tile_expert_ptr": "*i64",
            "tile_row0_ptr": "*i64", "tile_row_end_ptr": "*i64", "weights_ptr": "*fp32", "y_slot_ptr": "*fp32"}
#: hp is an i32 view of bf16 h in the down kernel, a bf16 output in the up kernel (`output_bf16`)
UP_OUTPUT = {"hp_ptr": "*bf16"}
BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def parse_config(text):
    """'BM,BR,BK,W,S,TWO,MAXNREG' -> the launcher's mx_config tuple; a clear usage error otherwise."""
    try:
        return mx_config_from_text(text)
    except ValueError as e:
        raise SystemExit(f"--configs: {e}") from None


def int_list(text):
    """'32,896' -> [32, 896] (argparse type: a clear usage error otherwise)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return values


def emitted_kernels(path):
    """(up, down) Gluon kernels of the emitted `moe_experts` module at `path`."""
    if not os.path.isfile(path):
        raise SystemExit(f"--module {path}: no such file (expected an artifact's kernels/kNNNN_moe_experts.py)")
    spec = importlib.util.spec_from_file_location("emitted_moe_experts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "moe_up_mx_gluon_kernel"):
        raise SystemExit(f"--module {path}: no moe_up_mx_gluon_kernel (not an MXFP4 moe_experts module)")
    return module.moe_up_mx_gluon_kernel, module.moe_down_mx_gluon_kernel


def word_descriptor_type(block_r, block_k):
    """Triton's signature type of the TMA descriptor `gl_word_descs` builds for [block_r, block_k/8]-word boxes."""
    from triton.runtime.jit import mangle_type

    return mangle_type(gl_word_descs(torch.zeros(1, block_r, block_k, dtype=torch.uint8), block_r, block_k))


def compile_kernel(kernel, constexprs, warps, maxnreg, output_bf16):
    """`kernel` compiled for sm_90a with `constexprs`, every pointer 16-byte aligned (the launcher's tensors are);
    with the TMA ring (STAGES ≥ 2) the words are descriptors."""
    signature = {n: (UP_OUTPUT.get(n) if output_bf16 else None) or POINTERS.get(n, "fp32") for n in kernel.arg_names}
    if constexprs["STAGES"] > 1:
        bk = constexprs.get("BLOCK_D", constexprs["BLOCK_K2"])
        signature.update({w: word_descriptor_type(constexprs["BLOCK_R"], bk) for w in ("w1", "w3", "w2")})
    divisible = [n for n, t in signature.items() if t.startswith("*")]
    return compile_for(kernel, signature, constexprs, num_warps=warps, maxnreg=maxnreg, divisible=divisible)


def loop_stats(code, weights_per_thread, tiles=1):
    """Counts per K tile over the K loop: the body between the target of the kernel's longest conditional
    backward branch and that branch (an unconditional one is the return from an out-of-line block, such as the
    mbarrier wait's retry loop, into the loop body), which holds `tiles` K tiles (2: the loop unrolled by two,
    activation prefetch mode 2). `weights_per_thread`: the weights one thread decodes per K tile (its warp's 16
    rows of each matrix × BLOCK_K / 32 lanes)."""
    loops = [(int(m.group(1), 16), a) for a, ins in code
             if ins.startswith("@") and (m := BRANCH.search(ins)) and int(m.group(1), 16) <= a]
    if not loops:
        return None
    top, end = max(loops, key=lambda t: t[1] - t[0])
    body = [ins for a, ins in code if top <= a <= end]
    op = [ins.split()[1] if ins.startswith("@") else ins.split()[0] for ins in body]

    def count(prefix):
        c = sum(o.startswith(prefix) for o in op)
        return c // tiles if c % tiles == 0 else round(c / tiles, 1)

    n = len(body)

    def span(prefixes):         # where in the body (0 .. 1; ptxas interleaves the tiles of an unrolled body)
        at = [i for i, o in enumerate(op) if o.startswith(prefixes)]
        return [round(at[0] / n, 2), round(at[-1] / n, 2)] if at else None

    return {"instructions": round(n / tiles, 1), "per_weight": round(n / tiles / weights_per_thread, 3),
            "LDG": count("LDG"), "LDGSTS": count("LDGSTS"), "UTMALDG": count("UTMALDG"), "LDS": count("LDS"),
            "BAR": count("BAR"), "HMMA": count("HMMA"), "moves": count("MOV") + count("IMAD.MOV") + count("PRMT"),
            "LDG128_at": span(("LDG.E.128",)), "TMA_at": span(("UTMALDG",))}


def ctas_per_sm(regs, shared, warps):
    """Resident CTAs an SM holds (module docstring's sm_90 limits)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (SM_REGISTERS // per_warp) // warps if per_warp else SM_CTAS
    by_shared = SM_SHARED // (shared + CTA_RESERVED)
    return min(by_regs, by_shared, SM_CTAS, SM_WARPS // warps)


def real_tiles(E, batch, block_m):
    """Schedule tiles holding rows for `batch` tokens routed uniformly at random (seed 0) to K of E experts."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(batch, E, generator=gen).argsort(-1)[:, :K].contiguous()
    tile_expert = moe_schedule(ids, E, block_m, use_kernel=False)[1]
    return int((tile_expert < E).sum())


def analyse(cfg, experts, batches, kernels, tiled=0):
    bm, two = cfg[0], cfg[5]
    kernel_cfgs = dict(zip(("up", "down"), mx_kernels(cfg)))
    bk1, bk2 = mx_block_k(D, kernel_cfgs["up"][1]), mx_block_k(I, kernel_cfgs["down"][1])
    row = {"config": list(cfg)}
    if not gluon_decode_ok(cfg, D, I, bk1, bk2):
        return {**row, "refused": "gluon_decode_ok"}
    common = dict(TWO_MULS=two, BLOCK_M=bm, BLOCK_K2=bk2, E=max(experts), D=D, I=I, TILED=tiled)
    up, down = kernels
    act_up, act_down = gl_act_ahead(cfg)
    launches = {"up": (up, dict(common, K=K, ACT_SITU=True, BLOCK_D=bk1, ACT_AHEAD=act_up), 2 * bk1, I),
                "down": (down, dict(common, ACT_AHEAD=act_down), bk2, D)}
    for name, (kernel, constexprs, columns, out_rows) in launches.items():
        br, _, warps, stages, cap = kernel_cfgs[name]
        constexprs.update(BLOCK_R=br, STAGES=stages)
        tiles = 2 if constexprs["ACT_AHEAD"] == 2 else 1
        c = compile_kernel(kernel, constexprs, warps, cap, output_bf16=name == "up")
        usage = resources(c.asm["cubin"])
        regs, spills = usage["REG"], usage["LOCAL"]
        shared = max(usage["SHARED"], c.metadata.shared)        # Triton's dynamic shared memory (the ring)
        fit = ctas_per_sm(regs, shared, warps)
        waves = {f"E{E}_B{b}": round(real_tiles(E, b, bm) * (out_rows // br) / (fit * SMS), 2)
                 for E in experts for b in batches}
        row[name] = {"registers": regs, "spills": spills, "shared": shared, "ctas_per_sm": fit, "waves": waves,
                     "loop": loop_stats(sass(c.asm["cubin"]), 16 * columns // 32, tiles)}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated mx_configs (module docstring)")
    ap.add_argument("--experts", type=int_list, default="32,896", help="experts E for the waves, comma-separated")
    ap.add_argument("--batches", type=int_list, default="1,16", help="decode batches for the waves, comma-separated")
    ap.add_argument("--module", default=None, help="an emitted MXFP4 moe_experts module whose kernels to compile")
    ap.add_argument("--out", default=None, help="directory for mx_static_cost.json")
    ap.add_argument("--tiled", type=int, choices=(0, 1, 2), default=0,
                    help="the words' layout: 0 row-major, 1 mxfp4_tiles, 2 mxfp4_tiles_bits (the decoding's bits)")
    args = ap.parse_args()
    experts, batches = args.experts, args.batches
    kernels = emitted_kernels(args.module) if args.module else (moe_up_mx_gluon_kernel, moe_down_mx_gluon_kernel)
    rows = [analyse(parse_config(c), experts, batches, kernels, args.tiled) for c in args.configs.split(";")]
    result = {"triton": triton.__version__, "target": "sm_90a", "module": args.module, "tiled": args.tiled,
              "shape": {"D": D, "I": I, "k": K}, "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mx_static_cost.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"triton {triton.__version__}, sm_90a, D {D}, I {I}, top-{K}; the K loop per warp and K tile "
          "(/weight: per weight a thread decodes; LDG.128 / TMA at: where the first and last issue, 0 top .. "
          "1 end)")
    print("config          kernel regs spill  smem CTA/SM instr /weight LDG TMA LDS BAR moves LDG.128 at  "
          "TMA at      waves")
    for r in rows:
        name = ",".join("-" if v is None else "/".join(str(int(x or 0)) for x in v) if isinstance(v, (tuple, list))
                        else str(int(v)) for v in r["config"])
        if "refused" in r:
            print(f"{name:15s} refused by {r['refused']}")
            continue
        for k in ("up", "down"):
            s, lp = r[k], r[k]["loop"] or {}
            at = " ".join(f"{'-'.join(map(str, lp.get(c) or ['-'])):10s}" for c in ("LDG128_at", "TMA_at"))
            print(f"{name:15s} {k:6s} {s['registers']:4d} {s['spills']:5d} {s['shared']:5d} {s['ctas_per_sm']:6d} "
                  f"{lp.get('instructions', 0):5.0f} {lp.get('per_weight', 0):7.3f} {lp.get('LDG', 0):3g} "
                  f"{lp.get('UTMALDG', 0):3g} {lp.get('LDS', 0):3g} {lp.get('BAR', 0):3g} {lp.get('moves', 0):5g} "
                  f"{at} "
                  + " ".join(f"{e}:{w}" for e, w in s["waves"].items()))


if __name__ == "__main__":
    main()
