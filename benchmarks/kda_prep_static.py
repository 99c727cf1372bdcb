"""Static cost of a chunked-prefill prep kernel for sm_90, compiled on a CPU machine (no GPU time): registers,
stack (spills), shared memory, SASS instructions, layout conversions. KDA at K3 shapes (H = 96, D = 128, bf16
activations, K3 gate), chunk 16 (--bt: another).

    python benchmarks/kda_prep_static.py [--kernel NAME] [--tree DIR] [--config NS:BK:WARPS,...]

--tree: the checkout whose k3c/codegen/triton/kda_chunk.py to compile (default: this one); --kernel: the
`@triton.jit` function in it; --config: NS, BK (passed only to kernels that take them; BK is also the front
kernel's BTOK) and num_warps;
--inv-precision: the tl.dot precision of its (I + A)^-1 products. Needs the
triton wheel's bundled cuobjdump. Counts are of the code, not of executed instructions: a loop body counts once.
"""

import argparse
import importlib.util
import os
import sys

# k3c.codegen.triton.offline of this checkout, loaded by path: --tree may import k3c from another checkout
_spec = importlib.util.spec_from_file_location(
    "k3c_offline", os.path.join(os.path.dirname(__file__), "..", "k3c", "codegen", "triton", "offline.py"))
offline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(offline)

FP32_ARGS = {"conv_w_q", "conv_w_k", "conv_w_v", "A_log", "dt_bias", "ws_glast", "conv_in"}


def stats(fn, consts, num_warps, maxnreg=None):
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr or name in consts:
            sig[name] = "constexpr"
        elif name in ("T", "NC", "B") or name.startswith("s_"):
            sig[name] = "i32"
        else:
            sig[name] = "*i32" if name == "lengths" else "*fp32" if name in FP32_ARGS else "*bf16"
    # pointers and integer arguments divisible by 16, as a launch at K3 shapes specializes them ("D")
    kernel = offline.compile_for(fn, sig, consts, num_warps=num_warps, num_stages=1, maxnreg=maxnreg,
                         divisible=[n for n in fn.arg_names if sig[n] != "constexpr"])
    usage = offline.resources(kernel.asm["cubin"])
    return dict(registers=usage["REG"], stack_bytes=usage["STACK"], smem=kernel.metadata.shared,
                sass=len(offline.sass(kernel.asm["cubin"])), converts=kernel.asm["ttgir"].count("convert_layout"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--kernel", default="kda_chunk_prep_kernel")
    ap.add_argument("--config", default="1:16:4")
    ap.add_argument("--bt", type=int, default=16, help="rows per chunk (BT)")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (launch option maxnreg)")
    ap.add_argument("--inv-precision", default="ieee", help="INV_PRECISION of the kernel (the launcher's choice)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    from k3c.codegen.triton import kda_chunk
    fn = getattr(kda_chunk, args.kernel)
    for cfg in args.config.split(","):
        ns, bk, warps = (int(x) for x in cfg.split(":"))
        consts = dict(H=96, D=128, W=4, BD=128, GATE_KIND=0, LOWER_BOUND=-5.0, SCALE=128 ** -0.5,
                      HAS_LENGTHS=False, BT=args.bt, LOG2_BT=args.bt.bit_length() - 1,
                      INV_PRECISION=args.inv_precision,
                      DOT_PRECISION="tf32")
        consts.update({k: v for k, v in (("NS", ns), ("BK", bk), ("BTOK", bk)) if k in fn.arg_names})
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        s = stats(fn, consts, warps, args.maxnreg)
        print(f"{args.kernel} NS={ns} BK={bk} warps={warps}: {s['registers']} registers, {s['stack_bytes']} B "
              f"stack, {s['smem']} B shared, {s['sass']} SASS instructions ({s['sass'] * 32 * warps // ns} per "
              f"chunk over the program's threads), {s['converts']} layout conversions", flush=True)


if __name__ == "__main__":
    main()
