"""The `wgmma` MXFP4 decode kernels (k3c.codegen.triton.moe_mxfp4_wgmma): their K order on the CPU (Triton's
interpreter), which configurations select them, their sm_90a binary compiled offline (Gluon has no interpreter),
and on a GPU their outputs against dequantize-then-GEMM and against the `mma.sync` Gluon kernels."""

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from k3c.codegen.triton import moe
from k3c.codegen.triton.moe_mxfp4 import ONE_MUL_MAX_SCALE, mx_config_from_text
from k3c.codegen.triton.moe_mxfp4_gluon import gluon_decode_ok
from k3c.codegen.triton.moe_mxfp4_wgmma import (WG_BLOCK_MS, wg_gather_kernel, wg_permute, wg_permuted_col,
                                               wg_tile_rows, wgmma_decode_ok)
from k3c.codegen.triton.moe_schedule import schedule_tiles
from k3c.codegen.triton.wg_ring import wg_pair_desc
from k3c.ir.ops import get_op
from k3c.runtime.layouts import mx_tile_bits, mx_tile_words

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WG = (16, 64, 256, 4, (2, 3), False, None, (3, 3))      # two launches; the default is their one-launch form:
DEFAULT = (*WG[:7], (4, 4))


@triton.jit
def _col_kernel(out_ptr, K: tl.constexpr):
    k = tl.arange(0, K)
    tl.store(out_ptr + wg_permuted_col(k), k)


def test_wg_permuted_col_inverts_permute():
    """The up kernel stores h column k at `wg_permuted_col(k)`; the launcher permutes z by `wg_permute`: the two
    must be one permutation, and it must keep each 128-column piece."""
    K = 512
    out = torch.empty(K, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    _col_kernel[(1,)](out, K=K)
    order = wg_permute(torch.arange(K).reshape(1, K))[0]
    assert torch.equal(out.long().cpu(), order)
    assert torch.equal(order.reshape(4, 128).sort(-1).values, torch.arange(K).reshape(4, 128))


def test_wg_permute_places_each_words_codes_in_its_fragment():
    """The K order from the fragment of `wgmma`'s register A operand (PTX ISA, "Register fragments", m64nNk16
    bf16: the thread of quad lane t holds columns 2t, 2t + 1 and 2t + 8, 2t + 9 of each k16 step, each pair in one
    32-bit register) and the decoding's registers (`mxfp4_word_bf16`: codes c and c + 4 of a word in one): thread
    t's word cc of a 128-column piece (natural columns 32t + 8cc .. + 7) fills the k16 steps 2cc and 2cc + 1, its
    register c = 2a + p in step 2cc + a at columns 8p + 2t, 8p + 2t + 1."""
    want = torch.empty(128, dtype=torch.long)
    for t in range(4):
        for cc in range(4):
            for c in range(4):
                a, p = divmod(c, 2)
                for e, code in enumerate((c, c + 4)):
                    want[16 * (2 * cc + a) + 8 * p + 2 * t + e] = 32 * t + 8 * cc + code
    assert torch.equal(wg_permute(torch.arange(128).reshape(1, 128))[0], want)


def test_the_gather_puts_each_tile_at_its_tile_rows_with_zero_padding():
    """`wg_gather_kernel` (Triton's interpreter, f32): schedule tile t's token rows (the tokens choosing its
    expert, in token order) at rows BM·t .. of zs in `wg_permute` order, the rest of its BM rows zeros, but rows
    8 .. of a tile of at most 8 tokens (which the kernels do not read) untouched, as are the rows of tiles past
    the schedule; with FLAGS, the counters flags[0 .. tiles] zeroed and nothing past them. Against a construction
    from those definitions, with experts of 0, 1, BM and more than BM rows and an unused slot."""
    N, k, E, D = 11, 3, 5, 512
    for BM in WG_BLOCK_MS:
        ids = torch.tensor([[0, 1, 2]] * 9 + [[0, 1, 4], [0, -1, 4]])       # experts 0: 11 rows, 1: 10, 3: none
        z = torch.randn(N, D, generator=torch.Generator().manual_seed(BM))
        order, tile_expert, row0, row_end = moe.moe_schedule(ids, E, BM, use_kernel=False)
        rows = wg_tile_rows(N * k, E, BM)
        assert rows == BM * tile_expert.shape[0]
        zs = torch.full((rows, D), float("nan"))
        flags = torch.full((rows + 1,), 7, dtype=torch.int32)
        wg_gather_kernel[(rows,)](z, order, tile_expert, row0, row_end, zs, flags, z.stride(0), E, K=k, D=D,
                                  BLOCK_M=BM, BLOCK=256, FLAGS=True)
        tiles = tile_expert.shape[0]      # the one-launch kernel's counters: the work item and each tile's count
        assert (flags[:tiles + 1] == 0).all() and (flags[tiles + 1:] == 7).all()
        t = 0
        for e in range(E):
            tokens = [n for n in range(N) if e in ids[n].tolist()]
            for c in range(0, len(tokens), BM):
                want = torch.zeros(BM, D)
                want[:len(tokens[c:c + BM])] = z[tokens[c:c + BM]]
                read = 8 if len(tokens[c:c + BM]) <= 8 else BM           # the rows the kernels read
                assert torch.equal(zs[BM * t:BM * t + read], wg_permute(want)[:read]), (BM, e, c)
                assert zs[BM * t + read:BM * (t + 1)].isnan().all(), (BM, e, c)
                t += 1
        assert t < tile_expert.shape[0] and zs[BM * t:].isnan().all()


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 40000), E=st.integers(1, 1024), scale_max=st.sampled_from([122, 127, 255]))
def test_planned_tile_rows_hold_every_schedule_and_the_declaration_evaluates_to_them(rows, E, scale_max):
    """`mx_wgmma_rows` (what the launch asks of the planned h and zs) holds a schedule of either tile height
    (`moe_schedule`'s tile count, `schedule_tiles`, times BM); `mx_wgmma_dim`, the scratch declaration, is the same
    number when its symbolic form is evaluated at the rows (sympy, as the runtime sizes it); both are 0 where the
    default never takes the `wgmma` kernels (two multiplies, f32, D or I not multiples of 256)."""
    import sympy

    planned = moe.mx_wgmma_rows(rows, E, 3584, 3072, scale_max, True)
    R = sympy.Symbol("R", positive=True, integer=True)
    dim = moe.mx_wgmma_dim(R, E, 3584, 3072, scale_max, True)
    if scale_max > ONE_MUL_MAX_SCALE:
        assert planned == 0 and dim == 0
        return
    assert all(planned >= BM * schedule_tiles(rows, E, BM) for BM in WG_BLOCK_MS)
    assert int(dim.subs(R, rows)) == planned == moe.mx_wgmma_dim(rows, E, 3584, 3072, scale_max, True)
    assert moe.mx_wgmma_rows(rows, E, 3584, 3072, scale_max, False) == 0
    assert moe.mx_wgmma_rows(rows, E, 3584 - 128, 3072, scale_max, True) == 0


@pytest.mark.parametrize("dtype,scale_max,wgmma", [("bf16", 122, True), ("bf16", 255, False), ("f32", 122, False)])
def test_the_scratch_declaration_plans_tile_rows_where_the_kernels_can_run(dtype, scale_max, wgmma):
    """`moe_experts_scratch` of a graph node: batch 16 of 32 experts choosing 16 at D, I multiples of 256 plans zs
    [768, D] (16 rows for each of the schedule's min(256, 16 + 32) tiles), h [768, I] in z's dtype and the
    one-launch form's counters wg_flags i32 [769] where the `wgmma` kernels can run (bf16, one multiply); two
    multiplies or f32 plan h [N·k, I] and neither zs nor wg_flags."""
    from k3c.ir.graph import Graph
    from k3c.ir.kernels import KernelGroup
    from k3c.ir.types import TensorType

    N, k, E, D, I = 16, 16, 32, 512, 256
    shapes = [((N, D), dtype), ((N, k), "f32"), ((N, k), "i64"), ((E, I, D // 2), "u8"), ((E, I, D // 2), "u8"),
              ((E, D, I // 2), "u8"), ((E, I, D // 32), "u8"), ((E, I, D // 32), "u8"), ((E, D, I // 32), "u8")]
    g = Graph()
    ins = [g.add_input(f"in{i}", TensorType(s, t)) for i, (s, t) in enumerate(shapes)]
    outs = g.add_node("moe_experts", ins, {"act": "situ", "weight_format": "mxfp4", "scale_max": scale_max})
    specs = {spec.name: spec.type for spec in moe.moe_experts_scratch(
        KernelGroup("k0001_moe_experts", "triton", "moe_experts", [g.nodes[0]], ins, outs))}
    rows = 16 * 48 if wgmma else N * k
    assert specs["h"] == TensorType((rows, I), dtype) and specs["y_slot"] == TensorType((N * k, D), "f32")
    assert specs.get("zs") == (TensorType((rows, D), dtype) if wgmma else None)
    assert specs.get("wg_flags") == (TensorType((rows + 1,), "i32") if wgmma else None)


def test_the_decode_default_takes_them_from_8_rows_per_expert_where_the_launch_can():
    """`mx_default_config`: one multiply, from 8 rows per expert (batch 16 of 32 experts choosing 16: measured
    faster, run S) to 16, the `wgmma` kernels in one launch (run Z); below 8 (batch 1: measured slower; 4-8: not
    timed) and where the launch cannot take them (`wgmma=False`: not bf16 on an sm_90 GPU, or D, I not multiples
    of 256) the `mma.sync` default; two multiplies and prefill keep theirs."""
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    mma = mx_default_config(16, 32, 122)
    assert mma[7] == (2, 0) and mx_default_config(8 * 32 - 1, 32, 122) == mma
    assert mx_default_config(8 * 32, 32, 122) == DEFAULT and mx_default_config(16 * 32 - 1, 32, 122) == DEFAULT
    assert mx_default_config(8 * 32, 32, 122, wgmma=False) == mma
    assert mx_default_config(8 * 32, 32, 122, "NVIDIA H100 80GB HBM3") == DEFAULT
    for rows, scale_max in ((8 * 32, 255), (16 * 32, 122)):
        assert mx_default_config(rows, 32, scale_max) == mx_default_config(rows, 32, scale_max, wgmma=False)
        assert not wgmma_decode_ok(mx_default_config(rows, 32, scale_max), 3584, 3072)


def test_configs_that_select_the_wgmma_kernels():
    """Activation modes (3, 3) select these kernels where the rest fits them, and never the `mma.sync` ones."""
    assert mx_config_from_text("16,64,256,4,2/3,0,0,3/3") == WG
    with pytest.raises(ValueError, match="or 3/3"):
        mx_config_from_text("16,64,256,4,2,0,0,3/0")
    assert wgmma_decode_ok(WG, 3584, 3072) and wgmma_decode_ok((8, 64, 256, 4, (2, 3), True, 96, (3, 3)), 512, 768)
    assert not gluon_decode_ok(WG, 3584, 3072, 256, 256)
    for bad in [WG[:7], (*WG[:7], (2, 0)), (32, *WG[1:]), (16, 32, *WG[2:]), (16, 64, 128, *WG[3:]),
                (16, 64, 256, 2, *WG[4:]), (16, 64, 256, 4, 1, *WG[5:]), (16, 64, 256, 4, (2, 1), *WG[5:]),
                (16, 64, 256, 4, 5, *WG[5:])]:
        assert not wgmma_decode_ok(bad, 3584, 3072), bad
    assert not wgmma_decode_ok(WG, 2304 + 128, 3072) and not wgmma_decode_ok(WG, 3584, 3072 - 64)


def test_the_pair_descriptor_spans_both_up_matrices_from_the_lower_address():
    """One TMA copy a K tile for w1 and w3 (`wg_pair_desc`): the word view of the one at the lower address with a
    leading dimension of 2 whose stride is the distance to the other, in i32 words; swap says w3 came first."""
    buf = torch.zeros(2, 3, 64, 256, dtype=torch.uint8)     # E 3, 64 rows, K 512: w3 lies 3·64·256 B = 12288 words on
    d, swap = wg_pair_desc(buf[0], buf[1], 2)
    assert swap == 0 and d.base.data_ptr() == buf.data_ptr()
    # tiled: [matrix, 32-row block (32 rows · 256 B = 2048 words), row of a K tile's tile, word]
    assert (list(d.shape), list(d.strides), list(d.block_shape)) == ([2, 6, 64, 32], [12288, 2048, 32, 1],
                                                                     [2, 2, 32, 32])
    d, swap = wg_pair_desc(buf[1], buf[0], 2)
    assert swap == 1 and d.base.data_ptr() == buf.data_ptr() and d.strides[0] == 12288
    d, _ = wg_pair_desc(buf[0], buf[1], 0)
    assert (list(d.shape), list(d.strides), list(d.block_shape)) == ([2, 192, 64], [12288, 64, 1], [2, 64, 32])
    for w3 in (buf[0], buf[1][:2]):
        with pytest.raises(ValueError, match="two tensors of one shape"):
            wg_pair_desc(buf[0], w3, 2)


def test_wgmma_kernels_compile_for_sm90():
    """Both kernels compiled for sm_90a in a process without the interpreter (k3c.codegen.triton.offline), with the
    decode default's fields from 8 rows per expert (`mx_default_config`: 16-token tiles, one multiply, the up
    kernel's ring of 2 stages, the down kernel's of 3; the default runs them as one launch's work items, whose
    kernel tests/codegen/test_moe_mxfp4_fused.py compiles) over `mxfp4_tiles_bits`: no spills; two K loops, a 16-token
    tile's and a narrow one's (`wg_narrow`), each unrolled by its ring's stages, and per K tile one `HGMMA`
    64x16x16 (the narrow loop: 64x8x16) per k16 step of each matrix (up 2 × 16, down 16) and the ring's refill:
    one 3-D TMA copy of the activations and one of the words, 3-D for the down kernel's one matrix, 4-D for both
    of the up kernel's (`wg_pair_desc`); the two paths share their shared memory (up 48 KB of rings)."""
    code = r"""
import collections, json, torch
from triton.runtime.jit import mangle_type
from k3c.codegen.triton.moe_mxfp4_wgmma import moe_up_mx_wgmma_kernel, moe_down_mx_wgmma_kernel
from k3c.codegen.triton.wg_ring import wg_act_desc, wg_pair_desc, wg_word_desc
from k3c.codegen.triton.offline import compile_for, resources, sass
wd = mangle_type(wg_word_desc(torch.zeros(1, 64, 256, dtype=torch.uint8), 2))
pair = torch.zeros(2, 1, 64, 256, dtype=torch.uint8)
wd13 = mangle_type(wg_pair_desc(pair[0], pair[1], 2)[0])
ad = mangle_type(wg_act_desc(torch.zeros(64, 256, dtype=torch.bfloat16), 16))
ad8 = mangle_type(wg_act_desc(torch.zeros(64, 256, dtype=torch.bfloat16), 8))
types = {"zs": ad, "hs": ad, "zs8": ad8, "hs8": ad8, "w13": wd13, "SWAP": "i32", "w2": wd, "hp_ptr": "*bf16",
         "weights_ptr": "*fp32", "y_slot_ptr": "*fp32", "SITU_BETA": "fp32", "SITU_LINEAR_BETA": "fp32"}
out = {}
for kernel in (moe_up_mx_wgmma_kernel, moe_down_mx_wgmma_kernel):
    stages = 2 if kernel is moe_up_mx_wgmma_kernel else 3
    cx = {k: v for k, v in dict(E=32, D=3584, I=3072, ACT_SITU=True, TWO_MULS=False, BLOCK_M=16, STAGES=stages,
                                TILED=2).items() if k in kernel.arg_names}
    sig = {n: types.get(n, "*i64" if n.startswith("tile") or n == "order_ptr" else "*u8")
           for n in kernel.arg_names if n not in cx}
    k = compile_for(kernel, sig, cx, num_warps=4, divisible=[n for n, t in sig.items() if t.startswith("*")])
    code = sass(k.asm["cubin"])
    branches = [(int(i.split("BRA ")[1].split()[0], 16), a) for a, i in code if i.startswith("@") and "BRA 0x" in i]
    out[kernel.__name__] = dict(resources(k.asm["cubin"]), shared=k.metadata.shared)
    for back in sorted((b for b in branches if b[0] < b[1]), key=lambda b: b[0] - b[1])[:2]:   # the K loops
        loop = collections.Counter(i.split()[1] if i.startswith("@") else i.split()[0] for a, i in code
                                   if back[0] <= a <= back[1])
        n = 8 if loop["HGMMA.64x8x16.F32.BF16"] else 16
        out[kernel.__name__][f"n{n}"] = dict(hgmma=loop[f"HGMMA.64x{n}x16.F32.BF16"] / stages,
                                             tma3=loop["UTMALDG.3D"] / stages, tma4=loop["UTMALDG.4D"] / stages,
                                             instructions=sum(loop.values()) / stages)
print(json.dumps(out))
"""
    from k3c.codegen.triton.moe_mxfp4 import mx_default_config

    assert mx_default_config(16 * 16, 32, 128) == DEFAULT          # batch 16 of 32 experts: 8 rows an expert
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    got = json.loads(run.stdout.strip().splitlines()[-1])
    up, down = got["moe_up_mx_wgmma_kernel"], got["moe_down_mx_wgmma_kernel"]
    print(got)      # registers, and instructions a K tile (BENCHMARKS.md "MXFP4 round, run S"; pytest -s)
    assert up["LOCAL"] == 0 and down["LOCAL"] == 0
    for n in ("n8", "n16"):
        assert (up[n]["hgmma"], up[n]["tma3"], up[n]["tma4"]) == (32, 1, 1), (n, got)
        assert (down[n]["hgmma"], down[n]["tma3"], down[n]["tma4"]) == (16, 2, 0), (n, got)
    assert up["shared"] < 2 * (2 * 8192 + 16 * 256 * 2) + 1024 and down["shared"] < 3 * (8192 + 8192) + 1024, got


def _case(seed, N, k, E, D, I, scales=(118, 124)):
    """A random bf16 MXFP4 launch on the GPU: z [N, D], routing weights and ids [N, k] of E experts, (w1, w3, w2,
    s1, s3, s2) packed u8 [E, rows, cols/2] with scale bytes in `scales` [E, rows, cols/32], the SiTU attrs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mats = [(torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device="cuda", generator=gen),
             torch.randint(*scales, (E, R, C // 32), dtype=torch.uint8, device="cuda", generator=gen))
            for R, C in ((I, D), (I, D), (D, I))]
    z = (torch.randn(N, D, device="cuda", generator=gen) * 0.5).bfloat16()
    ids = torch.rand(N, E, device="cuda", generator=gen).argsort(-1)[:, :k].contiguous()
    wt = torch.rand(N, k, device="cuda", generator=gen)
    (w1, s1), (w3, s3), (w2, s2) = mats
    return z, wt, ids, (w1, w3, w2, s1, s3, s2), {"act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mx_config", [WG, (8, 64, 256, 4, 2, True, None, (3, 3)),
                                       (16, 64, 256, 4, 3, False, None, (3, 3)),
                                       (16, 64, 256, 4, (2, 4), True, None, (3, 3)), DEFAULT,
                                       (8, 64, 256, 4, (3, 2), True, None, (4, 4))])
@pytest.mark.parametrize("tiled", [0, 1, 2])
@pytest.mark.parametrize("N", [1, 12, 24])
def test_wgmma_kernels_match_reference(N, tiled, mx_config, monkeypatch):
    """bf16 on the GPU, the words row-major or in either tiled layout (`mx_tile_words`, `mx_tile_bits`): the `wgmma`
    kernels (the launch is checked to take them) against dequantize-then-GEMM (`moe_experts`' reference, fp32) up to
    bf16 rounding of z and h, and against the `mma.sync` Gluon kernels (the same decoded values, another summation
    order). 6 experts choosing 4: N = 24 gives 96 rows, so experts of more than one 16-token tile and tiles cut
    short; N = 12 about 8 tokens an expert, tiles either side of `wg_narrow`'s 8; D and I give every ring at least
    twice its stages' K tiles (every mbarrier phase flips) plus one, so both kernels' loops end in a partial round
    of their stages, and two 64-row blocks an expert. Activation modes (4, 4): both phases in one launch
    (k3c.codegen.triton.moe_mxfp4_fused), launched twice, so the second launch starts from counters the gather
    zeroed after the first had left them counted up."""
    stages = max(mx_config[4]) if isinstance(mx_config[4], tuple) else mx_config[4]
    D, I = 256 * max(4, 2 * stages + 1), 256 * (2 * stages + 1)
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _case(7, N, 4, 6, D, I)
    relay = {0: lambda w: w, 1: mx_tile_words, 2: mx_tile_bits}[tiled]
    words = [relay(w) for w in (w1, w3, w2)]
    y, y_mma = torch.full_like(z, float("nan")), torch.full_like(z, float("nan"))
    taken, launches = [], moe.mx_wgmma_launches
    monkeypatch.setattr(moe, "mx_wgmma_launches", lambda *a, **kw: taken.append(1) or launches(*a, **kw))
    for _ in range(1 + (mx_config[7] == (4, 4))):
        y.fill_(float("nan"))
        moe.launch_moe_experts(z, wt, ids, *words, s1, s3, s2, y=y, mx_config=mx_config, tiled=tiled, **attrs)
    assert taken == [1] * len(taken) and taken
    moe.launch_moe_experts(z, wt, ids, *words, s1, s3, s2, y=y_mma, tiled=tiled, scale_max=123,
                           mx_config=(8, 32, 256, 2, 2, mx_config[5], None), **attrs)
    (want,) = get_op("moe_experts").ref({**attrs, "weight_format": "mxfp4"},
                                        *(t.cpu() for t in (z.float(), wt, ids, w1, w3, w2, s1, s3, s2)))
    scale = want.abs().max()
    assert not y.isnan().any()
    assert ((y.float().cpu() - want).abs().max() / scale).item() <= 1e-2
    assert ((y.float() - y_mma.float()).abs().max().cpu() / scale).item() <= 5e-3


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mx_config", [WG, DEFAULT])
def test_one_copy_takes_the_up_matrices_in_either_order(mx_config):
    """w1 and w3 in one buffer, either at the lower address (`wg_pair_desc`: the stage's first matrix; SWAP tells the
    up phase's epilogue which accumulator is the gate): the same bits either way, and dequantize-then-GEMM's
    values up to bf16 rounding (`mxfp4_tiles_bits`, about 8 tokens an expert)."""
    D, I = 256 * 7, 256 * 7
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _case(11, 12, 4, 6, D, I)
    out = []
    for w3_first in (False, True):
        buf = torch.empty(2, *w1.shape, dtype=torch.uint8, device="cuda")
        g, u = (buf[1], buf[0]) if w3_first else (buf[0], buf[1])
        g.copy_(mx_tile_bits(w1))
        u.copy_(mx_tile_bits(w3))
        assert wg_pair_desc(g, u, 2)[1] == int(w3_first)
        y = torch.full_like(z, float("nan"))
        moe.launch_moe_experts(z, wt, ids, g, u, mx_tile_bits(w2), s1, s3, s2, y=y, mx_config=mx_config, tiled=2,
                               **attrs)
        out.append(y)
    (want,) = get_op("moe_experts").ref({**attrs, "weight_format": "mxfp4"},
                                        *(t.cpu() for t in (z.float(), wt, ids, w1, w3, w2, s1, s3, s2)))
    assert torch.equal(out[0], out[1])
    assert ((out[0].float().cpu() - want).abs().max() / want.abs().max()).item() <= 1e-2
