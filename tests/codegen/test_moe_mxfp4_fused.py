"""The one-launch form of the `wgmma` MXFP4 decode kernels (k3c.codegen.triton.moe_mxfp4_fused): which configs
select it, the launcher's checks, and its sm_90a binary compiled offline (Gluon has no interpreter): the two
phases' rings sharing one allocation and the work counter's memory order in the SASS. Its outputs on a GPU are
`test_wgmma_kernels_match_reference`'s (tests/codegen/test_moe_mxfp4_wgmma.py, modes (4, 4))."""

import json
import os
import subprocess
import sys

import pytest
import torch

from k3c.codegen.triton.moe_mxfp4 import mx_config_from_text
from k3c.codegen.triton.moe_mxfp4_fused import mx_wgmma_launches
from k3c.codegen.triton.moe_mxfp4_wgmma import WG_FUSED_MODES, wgmma_decode_ok

FUSED = (16, 64, 256, 4, (2, 3), False, None, WG_FUSED_MODES)


def test_modes_4_4_select_the_one_launch_form():
    assert WG_FUSED_MODES == (4, 4)
    assert mx_config_from_text("16,64,256,4,2/3,0,0,4/4") == FUSED
    assert wgmma_decode_ok(FUSED, 3584, 3072) and not wgmma_decode_ok(FUSED, 3584, 3072 - 64)
    with pytest.raises(ValueError, match="4/4"):
        mx_config_from_text("16,64,256,4,2/3,0,0,4/3")


def test_the_end_to_end_profile_counts_the_one_launch_kernel_as_expert_time():
    """benchmarks/bench_e2e.py's expert read rate divides the expert bytes by the kernels `kind_of` calls "moe
    experts (Triton)": the one-launch kernel must be one of them, as the two kernels it replaces are; the slot sum
    is not."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "e2e_measure.py")
    spec = importlib.util.spec_from_file_location("e2e_measure", path)
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    for kernel in ("moe_mx_wgmma_fused_kernel", "moe_up_mx_wgmma_kernel", "moe_down_mx_wgmma_kernel"):
        assert measure.kind_of(kernel) == "moe experts (Triton)", kernel
    assert measure.kind_of("moe_sum_kernel") == "moe (Triton)"


def test_the_launcher_names_counters_too_short_for_the_schedule():
    """flags must hold the work counter and one count a tile: 1 + tiles entries."""
    E, I, D, tiles = 4, 256, 256, 6
    sched = (torch.zeros(8, dtype=torch.long), torch.zeros(tiles, dtype=torch.long),
             torch.zeros(tiles, dtype=torch.long), torch.zeros(tiles, dtype=torch.long))
    words = [torch.zeros(E, I, D // 2, dtype=torch.uint8)] * 3
    with pytest.raises(ValueError, match=r"flags \[6\].*1 \+ tiles"):
        mx_wgmma_launches(torch.zeros(2, D, dtype=torch.bfloat16), torch.zeros(16 * tiles, D, dtype=torch.bfloat16),
                          sched, *words, None, torch.zeros(16 * tiles, I, dtype=torch.bfloat16), None, None,
                          mx_config=FUSED, K=4, act="situ", situ_beta=4.0, situ_linear_beta=25.0, tiled=2,
                          flags=torch.zeros(tiles, dtype=torch.int32))


def test_it_compiles_for_sm90_with_one_ring_allocation_and_an_ordered_counter():
    """Compiled for sm_90a as the decode config would run it (16-token tiles, one multiply, rings of 2 and 3
    stages, `mxfp4_tiles_bits`): no spills; shared memory no larger than the up kernel's alone (the two phases'
    rings share it); both phases' `HGMMA`s (64x16x16 and the narrow tiles' 64x8x16); one `ATOMG` (the work
    item), one release `REDG` after a `MEMBAR.ALL.GPU` (an up item's count), the down items' acquire loads of the
    count (`LDG` strong at GPU scope, then `CCTL.IVALL`) and the proxy fence before their TMA reads
    (`FENCE.VIEW.ASYNC.G`)."""
    code = r"""
import collections, json, torch
from triton.runtime.jit import mangle_type
from k3c.codegen.triton.moe_mxfp4_fused import moe_mx_wgmma_fused_kernel as kernel
from k3c.codegen.triton.wg_ring import wg_act_desc, wg_pair_desc, wg_word_desc
from k3c.codegen.triton.offline import compile_for, resources, sass
wd = mangle_type(wg_word_desc(torch.zeros(1, 64, 256, dtype=torch.uint8), 2))
pair = torch.zeros(2, 1, 64, 256, dtype=torch.uint8)
wd13 = mangle_type(wg_pair_desc(pair[0], pair[1], 2)[0])
ad, ad8 = (mangle_type(wg_act_desc(torch.zeros(64, 256, dtype=torch.bfloat16), m)) for m in (16, 8))
types = {"zs": ad, "hs": ad, "zs8": ad8, "hs8": ad8, "w13": wd13, "SWAP": "i32", "w2": wd, "hp_ptr": "*bf16",
         "weights_ptr": "*fp32", "y_slot_ptr": "*fp32", "SITU_BETA": "fp32", "SITU_LINEAR_BETA": "fp32",
         "flags_ptr": "*i32", "TILES": "i32"}
cx = dict(E=32, D=3584, I=3072, ACT_SITU=True, TWO_MULS=False, BLOCK_M=16, STAGES_UP=2, STAGES_DOWN=3, TILED=2)
sig = {n: types.get(n, "*i64" if n.startswith("tile") or n == "order_ptr" else "*u8")
       for n in kernel.arg_names if n not in cx}
k = compile_for(kernel, sig, cx, num_warps=4, divisible=[n for n, t in sig.items() if t.startswith("*")])
ops = [i.split()[1] if i.startswith("@") else i.split()[0] for _, i in sass(k.asm["cubin"])]
print(json.dumps(dict(resources(k.asm["cubin"]), shared=k.metadata.shared, ops=ops)))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    ops = got.pop("ops")
    print(got)
    assert got["LOCAL"] == 0
    assert got["shared"] < 2 * (2 * 8192 + 16 * 256 * 2) + 1024, got
    assert "HGMMA.64x16x16.F32.BF16" in ops and "HGMMA.64x8x16.F32.BF16" in ops
    atomics = [op for op in ops if op.startswith(("ATOMG", "REDG"))]
    assert atomics == ["ATOMG.E.ADD.STRONG.GPU", "REDG.E.ADD.STRONG.GPU"], atomics
    red = ops.index("REDG.E.ADD.STRONG.GPU")
    assert "MEMBAR.ALL.GPU" in ops[red - 3:red], ops[red - 3:red + 1]
    acquire = [i for i, op in enumerate(ops) if op.startswith("LDG") and "STRONG.GPU" in op]
    assert acquire and all("CCTL.IVALL" in ops[i:i + 4] for i in acquire)
    assert ops.index("FENCE.VIEW.ASYNC.G") > max(acquire)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_a_relaunch_without_the_gather_returns_and_writes_nothing():
    """The counters are zeroed by the gather: launched again without it, the kernel's items all lie past its grid,
    so it returns at once and writes nothing (no down item waits on a count that never comes); with the gather
    again, the same bits as the first time."""
    from k3c.codegen.triton.moe_schedule import moe_schedule

    E, k, N, D, I = 6, 4, 12, 768, 768
    gen = torch.Generator(device="cuda").manual_seed(3)
    words = [torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device="cuda", generator=gen)
             for R, C in ((I, D), (I, D), (D, I))]
    scales = [torch.randint(118, 124, (E, R, C // 32), dtype=torch.uint8, device="cuda", generator=gen)
              for R, C in ((I, D), (I, D), (D, I))]
    z = (torch.randn(N, D, device="cuda", generator=gen) * 0.5).bfloat16()
    ids = torch.rand(N, E, device="cuda", generator=gen).argsort(-1)[:, :k].contiguous()
    wt = torch.rand(N, k, device="cuda", generator=gen)
    sched = moe_schedule(ids, E, 16)
    rows = 16 * sched[1].shape[0]
    zs, h = (torch.empty(rows, c, dtype=torch.bfloat16, device="cuda") for c in (D, I))
    y_slot = torch.zeros(N * k, D, device="cuda")
    gather, both = mx_wgmma_launches(z, zs, sched, *words, scales, h, y_slot, wt, mx_config=FUSED, K=k, act="situ",
                                     situ_beta=4.0, situ_linear_beta=25.0, tiled=0)
    gather()
    both()
    first = y_slot.clone()
    y_slot.zero_()
    both()
    torch.cuda.synchronize()
    assert first.abs().sum() > 0 and (y_slot == 0).all()
    gather()
    both()
    assert torch.equal(y_slot, first)
