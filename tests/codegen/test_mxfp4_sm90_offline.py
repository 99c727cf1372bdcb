"""The MXFP4 expert kernels compiled for the H200 (sm_90a) on a CPU machine, with the installed Triton, in a process
without TRITON_INTERPRET (Triton's bundled ptxas and cuobjdump; k3c.codegen.triton.offline).

The Gluon decode kernels (k3c.codegen.triton.moe_mxfp4_gluon) have no interpreter, so without this a CPU run never
compiles them: Gluon's cp.async and TMA builtins were renamed between Triton 3.6 (the device's) and 3.9
(pyproject's), which only a GPU run would have shown. They are compiled by benchmarks/mx_static_cost.py, and their
code has the shape the design states ("Word stream"). The Triton kernels get the MMA their K order assumes."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "mx_static_cost.py")
# mx_configs as the script takes them (BLOCK_M, BLOCK_R, BLOCK_K, warps, stages, two_muls, maxnreg): mx23's register
# prefetch, the decode default (a 2-stage TMA ring, the down kernel capped at 80 registers), 16-token tiles on a
# 3-stage ring with both multiplies, the default with both kernels' activations prefetched by the unrolled loop
# (`gl_act_ahead` mode 2), the H100 SXM's own decode config (`MX_DECODE_BY_DEVICE`: the up kernel on a 4-stage
# ring refilled 3 stages at a time)
H100 = "NVIDIA H100 80GB HBM3"
CONFIGS = ["8,32,256,2,1,0,0", "8,32,256,2,2,0,0/80", "16,32,256,2,3,1,0", "8,32,256,2,2,0,0/80,2/2",
           "8,32,256,2,4/2,0,0/80,1/0"]


def compile_offline(out, configs, *extra):
    """benchmarks/mx_static_cost.py over `configs` into directory `out`: {config text: row}, in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, SCRIPT, "--configs", ";".join(configs), "--experts", "32", "--batches",
                          "1", "--out", str(out), *extra], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out / "mx_static_cost.json") as f:
        return dict(zip(configs, json.load(f)["rows"]))


@pytest.fixture(scope="module")
def static_cost(tmp_path_factory):
    # the words as a session holds them (`mxfp4_tiles_bits`: the decoding of placed bits)
    return compile_offline(tmp_path_factory.mktemp("mx_static"), CONFIGS, "--tiled", "2")


def test_default_decode_config_is_compiled_here():
    """Each kernel of the decode default below 8 rows per expert (the up kernel's loop unrolled by two, mode 2;
    batch 1 of 32 or 896 experts, batch 16 of 896) is one compiled here: its fields and its activation prefetch
    mode; from 8 rows per expert the default is the `wgmma` kernels (run S)."""
    from k3c.codegen.triton.moe_mxfp4 import mx_config_from_text, mx_default_config, mx_kernels
    from k3c.codegen.triton.moe_mxfp4_gluon import gl_act_ahead

    def kernels(config):
        return [(*fields, act) for fields, act in zip(mx_kernels(config), gl_act_ahead(config))]

    small, large = mx_default_config(16, 896, 128), mx_default_config(16 * 16, 32, 128)
    assert small == mx_default_config(16, 32, 128)
    compiled = [kernels(mx_config_from_text(c)) for c in CONFIGS]
    assert kernels(small)[0] == compiled[3][0] and kernels(small)[1] == compiled[1][1]
    # from 8 rows per expert the `wgmma` kernels in one launch, compiled by test_moe_mxfp4_fused.py's offline test
    assert large == (16, 64, 256, 4, (2, 3), False, None, (4, 4))
    # a card's own decode config: the H100 SXM's below 4 rows per expert; from there it keeps the default's
    assert kernels(mx_default_config(16, 896, 128, H100)) == compiled[4]
    assert mx_default_config(16 * 16, 32, 128, H100) == large


@pytest.mark.parametrize("config", CONFIGS)
def test_gluon_kernels_compile_for_sm90_without_spills(static_cost, config):
    from k3c.codegen.triton.moe_mxfp4 import mx_config_from_text, mx_kernels
    from k3c.codegen.triton.moe_mxfp4_gluon import gl_act_ahead

    row = static_cost[config]
    block_m = int(config.split(",")[0])
    cfg = mx_config_from_text(config)
    # K3.1 Pro: BLOCK_K 256 divides D = 3584 and I = 3072; one ring stage holds BLOCK_R rows × BLOCK_K / 8
    # 32-bit words of each streamed matrix (up: w1 and w3, down: w2)
    for kernel, matrices, (block_r, block_k, _, stages, _), mode in zip(("up", "down"), (2, 1), mx_kernels(cfg),
                                                                         gl_act_ahead(cfg)):
        tiles = 2 if mode == 2 else 1                       # K tiles in the loop body (counts are per tile)
        r = row[kernel]
        assert r["spills"] == 0
        loop = r["loop"]
        if stages == 1:
            # mx23's register prefetch: no shared memory, no copies into it
            assert r["shared"] == 0 and loop["LDGSTS"] == loop["UTMALDG"] == loop["BAR"] == 0
        else:
            assert r["shared"] >= matrices * stages * block_r * block_k // 8 * 4
            # one TMA box per matrix and K tile, issued before the tile's decoding; no per-thread copies. A ring of
            # 2 stages refills one a tile; a deeper one its stages − 1 free stages together, every stages − 1 tiles
            # (`gl_ring_refill`: one branch of the loop issues those tiles' boxes back to back)
            boxes = matrices * (stages - 1)
            assert loop["UTMALDG"] == boxes and loop["LDGSTS"] == 0 and loop["TMA_at"][1] <= 1 - 0.5 / tiles
            # each thread reads back exactly its words: 2 rows × BLOCK_K / 32 words, 16 bytes a load
            assert loop["LDS"] == matrices * 2 * (block_k // 32) // 4
        assert loop["HMMA"] == matrices * block_k // 16 * block_m // 8
    if config.endswith("/80"):
        # the cap is the down kernel's alone: the up kernel keeps the registers its activations need
        assert row["down"]["registers"] <= 80 < row["up"]["registers"]


def test_unrolled_activation_prefetch_needs_no_copies(static_cost):
    # mode 1 carries the next tile's activations across the loop: each thread's 32 registers of them (8 tokens ×
    # 256 bf16 of K per warp: 128 bytes a thread) are copied at the back edge, so the up kernel's K loop holds at
    # least 32 moves a tile; mode 2 (the loop unrolled by two, each register set reloaded after its last use)
    # drops those copies, for the same registers, loads and MMAs (Triton 3.6: 83 -> 16 moves, 3.9: 74 -> 20.5)
    carried, unrolled = static_cost["8,32,256,2,2,0,0/80"]["up"], static_cost["8,32,256,2,2,0,0/80,2/2"]["up"]
    assert carried["loop"]["moves"] >= 32 and unrolled["loop"]["moves"] <= carried["loop"]["moves"] - 32
    assert unrolled["loop"]["instructions"] <= carried["loop"]["instructions"] - 32
    # over placed bits (`mxfp4_tiles_bits`) ptxas gives the unrolled loop more registers (Triton 3.6: 155 against
    # 123), 6 CTAs an SM against 8, which measured faster on the H200 and H100 (BENCHMARKS.md "MXFP4 round, run Q")
    assert unrolled["spills"] == 0 and unrolled["ctas_per_sm"] >= 6
    for key in ("HMMA", "LDG", "UTMALDG", "LDS"):
        assert unrolled["loop"][key] == carried["loop"][key]
    # the down kernel prefetches too (mode 0 loads at use) within its 80-register cap, without spilling and with
    # fewer moves than the 32 a carried prefetch copies (over placed bits, Triton 3.9: 29.5; row-major: 24)
    down = static_cost["8,32,256,2,2,0,0/80,2/2"]["down"]
    assert down["registers"] <= 80 and down["spills"] == 0 and down["loop"]["moves"] < 32


def test_occupancy_rule_matches_ncu():
    # BENCHMARKS.md "MXFP4 round (mx23)", ncu's launch statistics on the H200: 2-warp CTAs at 128 registers:
    # 8 per SM; at 80: 12; at 72: 14 (no shared memory); the register file is the limit in all three
    spec = importlib.util.spec_from_file_location("mx_static_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [module.ctas_per_sm(r, 0, 2) for r in (128, 80, 72)] == [8, 12, 14]
    # shared memory as the limit: 228 KB an SM, 1 KB reserved per CTA
    assert module.ctas_per_sm(56, 24 * 1024, 2) == 228 // 25


def test_emitted_module_kernels_compile(tmp_path):
    # the Gluon kernels as an artifact holds them: pasted into the emitted moe_experts module with their helpers
    # (a helper missing from the paste is a NameError only a compile shows)
    from k3c.codegen.triton import moe
    from k3c.ir.graph import Graph
    from k3c.ir.kernels import KernelGroup
    from k3c.ir.types import TensorType

    N, k, E, D, I = 4, 2, 4, 256, 128
    shapes = [((N, D), "bf16"), ((N, k), "f32"), ((N, k), "i64"), ((E, I, D // 2), "u8"), ((E, I, D // 2), "u8"),
              ((E, D, I // 2), "u8"), ((E, I, D // 32), "u8"), ((E, I, D // 32), "u8"), ((E, D, I // 32), "u8")]
    g = Graph()
    ins = [g.add_input(f"in{i}", TensorType(s, t)) for i, (s, t) in enumerate(shapes)]
    outs = g.add_node("moe_experts", ins, {"act": "situ", "weight_format": "mxfp4"}, name_hint="moe")
    path = tmp_path / "k0001_moe_experts.py"
    path.write_text(moe.emit_moe_experts(KernelGroup("k0001_moe_experts", "triton", "moe_experts", [g.nodes[0]],
                                                     ins, outs)))
    # its host side too: the launcher builds the TMA descriptors with the module's own helper
    spec = importlib.util.spec_from_file_location("emitted_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    # the per-card decode table travels with the module (the launcher picks the card's config at run time)
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    assert module.mx_default_config(16, 32, 122, H100) == mx_default_config(16, 32, 122, H100) != \
        mx_default_config(16, 32, 122)
    desc = module.gl_word_descs(torch.zeros(E, I, D // 2, dtype=torch.uint8), 32, 256)
    assert list(desc.shape) == [E * I, D // 8] and list(desc.block_shape) == [32, 32]
    rows = compile_offline(tmp_path, CONFIGS[1:], "--module", str(path))
    # the down kernel's ring issues one box per K tile a stage refilled (stages − 1 at a time: `gl_ring_refill`)
    from k3c.codegen.triton.moe_mxfp4 import mx_config_from_text, mx_kernels

    for c, r in rows.items():
        cfg = mx_config_from_text(c)
        assert r["up"]["spills"] == 0 and r["down"]["loop"]["UTMALDG"] == mx_kernels(cfg)[1][3] - 1


MMA_KIND = """
import json, sys
from k3c.codegen.triton.moe_mxfp4 import (moe_down_mx_kernel, moe_up_mx_kernel, mx_block_k, mx_default_config,
                                         mx_kernels, mx_mma_v2)
from k3c.codegen.triton.offline import compile_for, sass
D, I, K = 3584, 3072, 16
ptr = dict(zp_ptr="*bf16", hp_ptr="*bf16", w1_ptr="*i32", w3_ptr="*i32", w2_ptr="*i32", s1_ptr="*u8", s3_ptr="*u8",
           s2_ptr="*u8", order_ptr="*i64", tile_expert_ptr="*i64", tile_row0_ptr="*i64", tile_row_end_ptr="*i64",
           weights_ptr="*fp32", y_slot_ptr="*fp32", SITU_BETA="fp32", SITU_LINEAR_BETA="fp32")
out = {}
for rows, E in json.loads(sys.argv[1]):
    config = mx_default_config(rows, E, 128)
    bm, br, most_k, warps, _, two, maxnreg = config[:7]
    stages = [kernel[3] for kernel in mx_kernels(config)]           # (up, down)
    common = dict(E=E, D=D, I=I, FAST=True, TWO_MULS=two, BLOCK_M=bm, BLOCK_R=br, BLOCK_K2=mx_block_k(I, most_k),
                  DOT_PRECISION="tf32", V2=mx_mma_v2(warps))
    kinds, wide = [], []
    caps = maxnreg if isinstance(maxnreg, tuple) else (maxnreg, maxnreg)
    for tiled in (0, 2):        # row-major words, and the session's: tiles, bits placed
        for cap, n, kernel, consts in ((caps[0], stages[0], moe_up_mx_kernel,
                                        dict(common, K=K, ACT_SITU=True, V2_H=mx_mma_v2(warps),
                                             BLOCK_D=mx_block_k(D, most_k))),
                                       (caps[1], stages[1], moe_down_mx_kernel, common)):
            c = compile_for(kernel, ptr, dict(consts, TILED=tiled), num_warps=warps, num_stages=n, maxnreg=cap)
            ops = [ins.split()[0] for _, ins in sass(c.asm["cubin"])]
            kinds.append(sorted({o.split(".")[0] for o in ops} & {"HMMA", "HGMMA"}))
            wide.append(sum(o.startswith(("LDG.E.128", "LDGSTS.E.BYPASS.128")) for o in ops))
    out[f"{rows},{E}"] = [mx_mma_v2(warps), kinds, wide]
print(json.dumps(out))
"""


def test_triton_mxfp4_tiles_get_the_mma_their_k_order_assumes():
    # the Triton MXFP4 kernels store the decoded weights and the activations in the K order of the MMA they expect
    # (`mx_mma_v2`: mma.sync for 1-2 warps, wgmma for 4+); Triton picks the MMA by the tile, warps and its version,
    # and a mismatch still computes the same sums but through shared memory. At every regime of
    # `mx_default_config` (decode of 896 experts, batch 16 and 64 of 32 experts, prefill), compiled for sm_90a with
    # the installed Triton, the SASS holds exactly the MMA the order assumes, over row-major and tiled words
    import json

    regimes = [(16, 896), (256, 32), (1024, 32), (32768, 32)]   # 8-row Gluon-form tiles to 16 E, then 32, 128
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", MMA_KIND, json.dumps(regimes)], capture_output=True, text=True,
                         env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert set(got) == {f"{r},{e}" for r, e in regimes}
    for key, (v2, kinds, wide) in got.items():
        assert kinds == [["HMMA"] if v2 else ["HGMMA"]] * 4, key
        # the words' tiled layout (`mx_word_offset`; `mxfp4_tiles_bits`) keeps every 16-byte load of the row-major one
        assert wide[:2] == wide[2:] and min(wide) > 0, (key, wide)
