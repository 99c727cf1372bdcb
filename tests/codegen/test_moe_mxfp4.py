"""The MXFP4 expert kernels' pieces (k3c.codegen.triton.moe_mxfp4, moe_mxfp4_gluon): the K order of the activations,
the scale bytes, the decode configurations and, on a GPU, the bf16 launcher (Triton and Gluon kernels, row-major
and tiled words) against the reference. The words' decoding and layouts: test_mxfp4_words.py."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from k3c.codegen.triton import moe
from k3c.codegen.triton.moe_mxfp4 import (MX_DECODE_BY_DEVICE, mx_block_k, mx_config_from_text, mx_default_config,
                                         mx_kernels, mx_permute, mx_permuted_col, mxfp4_scales)
from k3c.codegen.triton.gl_ring import gl_word_descs
from k3c.codegen.triton.moe_mxfp4_gluon import gl_act_ahead, gl_permute, gl_permuted_col, gluon_decode_ok
from k3c.ir.ops import get_op
from k3c.runtime.layouts import mx_tile_bits, mx_tile_words

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def kernel_order(K, block_k, v2=False):
    """Natural k of every permuted column, from the module docstring's rules (wgmma: column
    32·cc + 16·cl + 8p + 2t + e holds in-tile k = 8·(t·CC + cc) + 4e + 2·cl + p; v2: column 32·cc + 8t + 2q + e
    holds 8·(t·CC + cc) + 4e + q), written independently of the code."""
    CC = block_k // 32
    cols = torch.empty(K, dtype=torch.long)
    for tile in range(K // block_k):
        for cc in range(CC):
            for t in range(4):
                for e in (0, 1):
                    for q in range(4):
                        col = 32 * cc + 8 * t + 2 * q + e if v2 else 32 * cc + 8 * q + 2 * t + e
                        cols[tile * block_k + col] = tile * block_k + 8 * (t * CC + cc) + 4 * e + q
    return cols


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("K,most", [(96, 256), (256, 256), (3584, 256), (3072, 512)])
def test_mx_permute_order(K, most, v2):
    bk = mx_block_k(K, most)
    assert K % bk == 0 and bk >= 32 and (bk * 2 > most or K % (bk * 2))
    x = torch.arange(2 * K).reshape(2, K)
    want = kernel_order(K, bk, v2)
    assert torch.equal(mx_permute(x, bk, v2=v2), x[:, want])


@triton.jit
def _col_kernel(out_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr, V2: tl.constexpr):
    k = tl.arange(0, K)
    tl.store(out_ptr + mx_permuted_col(k, BLOCK_K, V2), k)


@pytest.mark.parametrize("v2", [False, True])
def test_mx_permuted_col_inverts_permute(v2):
    K, bk = 128, 64
    out = torch.empty(K, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    _col_kernel[(1,)](out, K=K, BLOCK_K=bk, V2=v2)
    assert torch.equal(out.long().cpu(), kernel_order(K, bk, v2))


@triton.jit
def _scales_kernel(s_ptr, out_ptr, R: tl.constexpr, KDIM: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, R).to(tl.int64)
    CC: tl.constexpr = BLOCK_K // 32
    idx = (rows[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]) * CC + tl.arange(0, CC)[None, None, :]
    for k0 in range(0, KDIM, BLOCK_K):
        s = mxfp4_scales(s_ptr, rows, rows < R - 1, k0, KDIM, BLOCK_K, True, False)
        tl.store(out_ptr + (k0 // BLOCK_K) * R * 4 * CC + idx, s)


@pytest.mark.parametrize("block_k", [32, 64, 128, 256, 512])
def test_scales_per_word(block_k):
    """The bf16 decoder's scale per packed word: word (t, cc) of a row's K tile (the thread-t-reads-words-t·CC..
    rule of the module docstring) lies in 32-value group (t·CC + cc) // 4 of the tile; masked rows read 127."""
    R, KDIM = 8, 1024
    CC = block_k // 32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = torch.randint(0, 256, (R, KDIM // 32), dtype=torch.uint8)
    out = torch.empty(KDIM // block_k, R, 4, CC, dtype=torch.uint8, device=dev)
    _scales_kernel[(1,)](s.to(dev), out, R=R, KDIM=KDIM, BLOCK_K=block_k)
    out = out.cpu()
    want = torch.empty_like(out)
    for tile in range(KDIM // block_k):
        for t in range(4):
            for cc in range(CC):
                want[tile, :, t, cc] = s[:, tile * CC + (t * CC + cc) // 4]
    want[:, R - 1] = 127
    assert torch.equal(out, want)


def test_even_unroll_takes_mode_1_for_an_odd_count_of_k_tiles():
    """`mx_even_unroll`: the up kernel's unrolled prefetch (mode 2) only over an even count of K tiles; the rest of
    the config, other modes and configs without the field unchanged; the decode default below 8 rows per expert
    (batch 1 and 3 of 32 experts) is mode 2 (run Q), which K3.1 Pro's latent (3584: 14 tiles of 256) keeps and a
    2304-wide one (9) drops to 1; from 8 rows per expert the `wgmma` kernels' config (modes (4, 4)) is unchanged
    and takes 9 K tiles too (its loop's tail)."""
    from k3c.codegen.triton.moe_mxfp4 import mx_even_unroll
    from k3c.codegen.triton.moe_mxfp4_wgmma import wgmma_decode_ok

    wg = mx_default_config(256, 32, 122)
    assert wg[7] == (4, 4) and mx_even_unroll(wg, 9) == wg and wgmma_decode_ok(wg, 2304, 3072)
    for rows in (16, 48):
        cfg = mx_default_config(rows, 32, 122)
        assert cfg[7] == (2, 0) and mx_even_unroll(cfg, 3584 // 256) == cfg
        assert mx_even_unroll(cfg, 2304 // 256) == (*cfg[:7], (1, 0))
        assert gluon_decode_ok(mx_even_unroll(cfg, 9), 2304, 3072, 256, 256)
        assert not gluon_decode_ok(cfg, 2304, 3072, 256, 256)
    assert mx_even_unroll((8, 32, 256, 2, 2, False, None, (1, 2)), 9) == (8, 32, 256, 2, 2, False, None, (1, 2))
    assert mx_even_unroll((8, 32, 256, 2, 2, False, None), 9) == (8, 32, 256, 2, 2, False, None)


def _bf16_case(seed, N, k, E, D, I, device="cuda"):
    """A random bf16 MXFP4 launch: z [N, D] bf16, routing weights [N, k] and ids [N, k] of E experts, (w1, w3, w2,
    s1, s3, s2) packed u8 [E, rows, cols/2] with scale bytes 118..123 (one-multiply range) [E, rows, cols/32],
    and the SiTU attrs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    (w1, s1), (w3, s3), (w2, s2) = [(torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, device=device,
                                                   generator=gen),
                                     torch.randint(118, 124, (E, R, C // 32), dtype=torch.uint8, device=device,
                                                   generator=gen)) for R, C in ((I, D), (I, D), (D, I))]
    z = (torch.randn(N, D, device=device, generator=gen) * 0.5).bfloat16()
    ids = torch.rand(N, E, device=device, generator=gen).argsort(-1)[:, :k].contiguous()
    wt = torch.rand(N, k, device=device, generator=gen)
    return z, wt, ids, (w1, w3, w2, s1, s3, s2), {"act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mx_config", [None, (8, 64, 256, 2, 2, False, None), (8, 32, 256, 2, 2, False, None)])
@pytest.mark.parametrize("N", [1, 40])
def test_launch_bf16_matches_reference(N, mx_config):
    """bf16 activations (the PTX path), decode (N = 1) and 64-row tiles (N = 40), I with a 32-wide K tile, the
    launcher's configuration and an `mma.sync` one: the reference's dequantize-then-GEMM up to bf16 rounding of z
    and h."""
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _bf16_case(1, N, 4, 6, 256, 160)
    y = torch.full_like(z, float("nan"))
    moe.launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y, mx_config=mx_config, **attrs)
    (want,) = get_op("moe_experts").ref({**attrs, "weight_format": "mxfp4"},
                                        *(t.cpu() for t in (z.float(), wt, ids, w1, w3, w2, s1, s3, s2)))
    err = ((y.float().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-2, err


@pytest.mark.parametrize("mx_config", [(8, 32, 64, 2, 1, True, None),
                                       (8, (32, 64), (64, 32), (2, 4), (1, 2), True, (None, 96)),
                                       (8, (64, 32), (32, 64), (4, 2), 1, True, None)])
def test_launch_mma_v2_order_matches_reference(mx_config):
    """The `mma.sync` K order end to end (fp32 activations, so the portable decoding; 2 warps: `mx_mma_v2`):
    z permuted in that order, h written by the up kernel in it and read back by the down kernel, two K tiles of
    two 32-value groups each: equal to the reference's dequantize-then-GEMM in fp32. Then each kernel with its
    own fields (`mx_kernels`): weight rows, K tile, warps and so MMA order, stages, register cap; the up kernel
    writes h in the down kernel's order (its K tile, `mma.sync` or `wgmma`), which is what the down kernel reads."""
    gen = torch.Generator().manual_seed(3)
    N, k, E, D, I = 3, 2, 3, 128, 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    (w1, s1), (w3, s3), (w2, s2) = [(torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, generator=gen),
                                     torch.randint(124, 129, (E, R, C // 32), dtype=torch.uint8, generator=gen))
                                    for R, C in ((I, D), (I, D), (D, I))]
    z = torch.randn(N, D, generator=gen) * 0.1
    ids = torch.tensor([[0, 2], [2, 1], [1, -1]])
    wt = torch.rand(N, k, generator=gen)
    attrs = {"act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}
    args = [t.to(dev) for t in (z, wt, ids, w1, w3, w2, s1, s3, s2)]
    y = torch.full_like(args[0], float("nan"))
    moe.launch_moe_experts(*args, y=y, mx_config=mx_config, **attrs)
    (want,) = get_op("moe_experts").ref({**attrs, "weight_format": "mxfp4"}, z, wt, ids, w1, w3, w2, s1, s3, s2)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-4, atol=1e-5)


def test_launch_tiled_words_match_row_major():
    """The launcher over the words' tiled copies (`mx_tile_words`, tiled=1: every kernel addresses them by
    `mx_word_offset`; `mx_tile_bits`, tiled=2: also decodes the placed bits, `mx_word_code`) gives bitwise the
    output of the row-major words (fp32 activations: the interpreter's portable decoding; D = I = 512: every
    matrix has 32-row blocks and two 256-value K tiles a row, so every term of the offset moves, in the up and the
    down kernel); shapes that are not whole tiles and a layout code outside 0..2 raise ValueError."""
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _bf16_case(4, 3, 2, 3, 512, 512, device="cpu")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = [t.to(dev) for t in (z.float(), wt, ids)]
    y = torch.full_like(args[0], float("nan"))
    moe.launch_moe_experts(*args, *(t.to(dev) for t in (w1, w3, w2, s1, s3, s2)), y=y, **attrs)
    assert not y.isnan().any()
    for code, relay in ((1, mx_tile_words), (2, mx_tile_bits)):
        y_tiled = torch.full_like(args[0], float("nan"))
        tiled = [relay(w).to(dev) for w in (w1, w3, w2)]
        moe.launch_moe_experts(*args, *tiled, *(t.to(dev) for t in (s1, s3, s2)), y=y_tiled, tiled=code, **attrs)
        assert torch.equal(y.view(torch.int32), y_tiled.view(torch.int32)), code
    with pytest.raises(ValueError, match=r"tiled must be a word layout code 0, 1 or 2, got 3"):
        moe.launch_moe_experts(*args, *tiled, *(t.to(dev) for t in (s1, s3, s2)), y=y_tiled, tiled=3, **attrs)
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _bf16_case(4, 3, 2, 3, 256, 160, device="cpu")
    with pytest.raises(ValueError, match=r"tiled MXFP4 words need D \(256\) and I \(160\) multiples of 256"):
        moe.launch_moe_experts(z.float(), wt, ids, w1, w3, w2, s1, s3, s2, y=z.float(), tiled=True, **attrs)


@triton.jit
def _gl_col_kernel(out_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    k = tl.arange(0, K)
    tl.store(out_ptr + gl_permuted_col(k, BLOCK_K), k)


def test_gl_permute_order():
    """The Gluon kernels' activation order (`gl_permute`): column 64b + 16t + 4q + 2s + e of a K tile holds
    k = 8·(t·CC + 2b + s) + 4e + q, CC = BLOCK_K/32 (written independently of the code); `gl_permuted_col` (the
    up kernel's h columns) is its inverse, two K tiles of 128."""
    K, bk = 256, 128
    CC = bk // 32
    want = torch.empty(K, dtype=torch.long)
    for tile in range(K // bk):
        for b in range(CC // 2):
            for t in range(4):
                for q in range(4):
                    for s in (0, 1):
                        for e in (0, 1):
                            want[tile * bk + 64 * b + 16 * t + 4 * q + 2 * s + e] = \
                                tile * bk + 8 * (t * CC + 2 * b + s) + 4 * e + q
    x = torch.arange(2 * K).reshape(2, K)
    assert torch.equal(gl_permute(x, bk), x[:, want])
    out = torch.empty(K, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    _gl_col_kernel[(1,)](out, K=K, BLOCK_K=bk)
    assert torch.equal(out.long().cpu(), want)


def test_gluon_decode_ok():
    """The Gluon decode kernels take the decode default at K3.1 Pro's expert shapes (8-token tiles, 32 rows on 2
    warps, 256-wide K tiles) and 16-token tiles, not 32-token tiles, partial weight-row blocks, 32 rows per warp
    or K tiles under 128."""
    D, I = 3584, 3072
    assert gluon_decode_ok(mx_default_config(16, 896, 122), D, I, 256, 256)
    assert gluon_decode_ok((16, 32, 256, 2, 3, False, None), D, I, 256, 256)
    assert not gluon_decode_ok((16, 64, 256, 4, 3, False, None), D, I, 256, 256)      # 4 warps: wgmma tiles
    assert not gluon_decode_ok((32, 64, 256, 4, 3, False, None), D, I, 256, 256)      # 32-token tiles
    assert not gluon_decode_ok((8, 64, 256, 2, 2, False, None), D, I, 256, 256)       # 32 rows per warp
    assert not gluon_decode_ok((8, 32, 256, 2, 2, False, None), D, 160, 256, 32)      # I = 5 · 32, K tile 32
    # the TMA ring (num_stages ≥ 2) reads a K tile as one swizzled box row of at most 128 bytes: K tiles ≤ 256;
    # the register stream takes 512
    assert gluon_decode_ok((8, 32, 512, 2, 1, False, None), 4096, 4096, 512, 512)
    assert not gluon_decode_ok((8, 32, 512, 2, 2, False, None), 4096, 4096, 512, 512)
    # activation prefetch mode 2 unrolls a kernel's K loop by two: K3.1 Pro has 14 K tiles of 256 over D and 12
    # over I; an odd count (D = 3 · 256, the up kernel's) is refused for the kernel that would unroll
    unrolled = (8, 32, 256, 2, 2, False, (None, 80), (2, 2))
    assert gluon_decode_ok(unrolled, D, I, 256, 256)
    assert not gluon_decode_ok(unrolled, 768, I, 256, 256)
    assert gluon_decode_ok(unrolled[:7] + ((1, 2),), 768, I, 256, 256)
    # each kernel is checked with its own fields (`mx_kernels`): up 16 rows on 1 warp, register stream, 512-wide K
    # tiles; down 32 rows on 2 warps, TMA ring, 256
    mixed = (8, (16, 32), (512, 256), (1, 2), (1, 2), False, None)
    assert gluon_decode_ok(mixed, 4096, 4096, 512, 256)
    assert not gluon_decode_ok(mixed[:4] + (2,) + mixed[5:], 4096, 4096, 512, 256)          # a ring takes ≤ 256
    assert not gluon_decode_ok(mixed[:3] + ((1, 1),) + mixed[4:], 4096, 4096, 512, 256)     # 32 rows on 1 warp
    # mode 2 needs an even K tile count in its own kernel only: 3 tiles of 256 over D = 768 (up), 4 over I
    assert gluon_decode_ok((8, 32, (128, 256), 2, 2, False, None, (2, 2)), 768, 1024, 128, 256)
    assert not gluon_decode_ok((8, 32, (256, 128), 2, 2, False, None, (2, 2)), 768, 1024, 256, 128)


def test_act_ahead_modes():
    # the rule measured in mx27: register word stream: both kernels one tile ahead (carried); TMA ring: the up
    # kernel carried at 8-token tiles, at use at 16; the down kernel at use
    assert gl_act_ahead((8, 32, 256, 2, 1, False, None)) == (1, 1)
    assert gl_act_ahead((8, 32, 256, 2, 2, False, (None, 80))) == (1, 0)
    assert gl_act_ahead((16, 32, 256, 2, 3, False, None)) == (0, 0)
    # an explicit 8th field wins over the rule, None keeps it
    assert gl_act_ahead((16, 32, 256, 2, 3, False, None, (2, 1))) == (2, 1)
    assert gl_act_ahead((8, 32, 256, 2, 2, False, None, None)) == (1, 0)
    for bad in ((3, 0), (1,), (0, -1), (0, 3)):
        with pytest.raises(ValueError, match="prefetch modes"):
            gl_act_ahead((8, 32, 256, 2, 2, False, None, bad))


def test_mx_config_text():
    assert mx_config_from_text("8,32,256,2,2,0,0/80") == (8, 32, 256, 2, 2, False, (None, 80))
    assert mx_config_from_text("16,32,256,2,1,1,96") == (16, 32, 256, 2, 1, True, 96)
    assert mx_config_from_text("8,32,256,2,1,0,0")[6] is None
    assert mx_config_from_text("8,32,256,2,2,0,0/80,2/0") == (8, 32, 256, 2, 2, False, (None, 80), (2, 0))
    with pytest.raises(ValueError, match=r"'8,32,256,2,2,0,0/80,1/3': expected .*act: UP/DOWN, each 0, 1 or 2"):
        mx_config_from_text("8,32,256,2,2,0,0/80,1/3")
    # one value per kernel (`mx_kernels`): BLOCK_R, BLOCK_K, warps, stages, maxnreg; BLOCK_M and two_muls shared
    mixed = mx_config_from_text("8,32/16,128/256,2/1,1/2,0,80/0,2/0")
    assert mixed == (8, (32, 16), (128, 256), (2, 1), (1, 2), False, (80, None), (2, 0))
    assert mx_kernels(mixed) == ((32, 128, 2, 1, 80), (16, 256, 1, 2, None))
    assert mx_kernels(mx_default_config(16, 896, 122)) == ((32, 256, 2, 2, None), (32, 256, 2, 2, 80))
    with pytest.raises(ValueError, match="field 2 must be one value or an"):
        mx_kernels((8, 32, (128, 256, 64), 2, 2, False, None))
    for bad in ("8,32,256,2,2,0", "8,32,256,2,2,0,0/80/72", "8,32,x,2,2,0,0", "", "8,32,256,2,2,0,0,3/0",
                "8,32,256,2,2,0,0,0/4",
                "8,32,256,2,2,0,0,2", "8,32,256,2,2,0,0,2/0,1", "8/16,32,256,2,2,0,0", "8,32,256,2,2,0/1,0",
                "8,32,128/256/512,2,2,0,0"):
        with pytest.raises(ValueError, match="BLOCK_M,BLOCK_R,BLOCK_K"):
            mx_config_from_text(bad)


@settings(max_examples=200, deadline=None)
@given(D=st.integers(1, 64).map(lambda n: 128 * n), I=st.integers(1, 64).map(lambda n: 128 * n),
       E=st.sampled_from([8, 32, 896]), tokens=st.integers(1, 64))
def test_a_cards_own_decode_config_takes_every_shape_the_default_takes(D, I, E, tokens):
    # a card's entry (`MX_DECODE_BY_DEVICE`) must not send a shape the default runs on the Gluon kernels to the
    # slower Triton kernels; it applies below 4 rows per expert with one multiply, and nowhere else
    rows = 16 * tokens
    default = mx_default_config(rows, E, 122)
    for device, tuned in MX_DECODE_BY_DEVICE.items():
        cfg = mx_default_config(rows, E, 122, device)
        assert cfg == (tuned if rows < 4 * E else default)
        assert mx_default_config(rows, E, 255, device) == mx_default_config(rows, E, 255)
        (_, bk1, *_), (_, bk2, *_) = mx_kernels(default)
        (_, tk1, *_), (_, tk2, *_) = mx_kernels(cfg)
        if gluon_decode_ok(default, D, I, mx_block_k(D, bk1), mx_block_k(I, bk2)):
            assert gluon_decode_ok(cfg, D, I, mx_block_k(D, tk1), mx_block_k(I, tk2))


def test_word_descriptors():
    # w u8 [E, R, C/2] as i32 words [E·R, C/8], [BLOCK_R, BLOCK_K/8]-word boxes, one K tile row = BLOCK_K/2 bytes,
    # swizzled by that width; the descriptor is host data, built here without a GPU
    w = torch.zeros(3, 64, 512, dtype=torch.uint8)
    d = gl_word_descs(w, 32, 256)
    assert list(d.shape) == [192, 128] and list(d.block_shape) == [32, 32] and d.layout.swizzle_byte_width == 128
    assert gl_word_descs(w, 16, 128).layout.swizzle_byte_width == 64
    with pytest.raises(ValueError, match=r"MXFP4 words \[3, 64, 256\] must be contiguous"):
        gl_word_descs(w[:, :, ::2], 32, 256)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gl_word_descs(w.view(-1)[1:1 + 3 * 64 * 480].view(3, 64, 480), 32, 256)
    # tiled: the rows of the [32 rows, 32 words] tiles one after another, E·R·C/256 of them
    d = gl_word_descs(w, 32, 256, tiled=True)
    assert list(d.shape) == [768, 32] and list(d.block_shape) == [32, 32] and d.layout.swizzle_byte_width == 128
    assert list(gl_word_descs(w, 16, 128, tiled=True).block_shape) == [16, 16]
    with pytest.raises(ValueError, match="multiple of 128 bytes"):
        gl_word_descs(w[:, :, :64].contiguous(), 32, 256, tiled=True)
    with pytest.raises(ValueError, match="boxes of at most 32 rows and 256 values of 32-row blocks, got 64 rows"):
        gl_word_descs(w, 64, 256, tiled=True)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mx_config", [(8, 32, 256, 2, 1, False, None), (8, 16, 128, 1, 1, True, None),
                                       (8, 32, 256, 2, 2, False, (None, 80)), (8, 32, 256, 2, 4, True, None),
                                       (16, 32, 256, 2, 1, False, None), (16, 16, 128, 1, 3, True, None),
                                       (16, 32, 256, 2, 2, False, 96), (8, 32, 256, 2, 2, False, (80, 80), (2, 0)),
                                       (8, 32, 256, 2, 2, False, (None, 80), (2, 0)),
                                       (8, 32, 128, 2, 2, False, None, (2, 2)), (8, 32, 128, 2, 1, True, None, (2, 2)),
                                       (16, 16, 128, 1, 3, False, None, (2, 2)),
                                       (8, 32, (128, 256), 2, (1, 2), False, (80, 80), (2, 0)),
                                       (16, (16, 32), 128, (1, 2), (3, 1), True, None),
                                       (8, 32, 256, 2, (4, 2), False, (None, 80), (1, 0)),
                                       (16, 32, 128, 2, (2, 4), False, None, (0, 0))])
@pytest.mark.parametrize("N", [1, 5, 12])
def test_gluon_matches_triton_and_reference(N, mx_config):
    """The Gluon decode kernels (bf16, K tiles prefetched in registers) against the Triton kernels of the same
    configuration, bitwise (the same decoded values and `mma.sync` sums in the same order), and against the
    reference up to bf16 rounding of z and h; two K tiles over D and I, one and two multiplies, 8- and 16-token
    tiles (N = 12: 48 rows over 6 experts, so 16-token tiles fill both n8 halves), the words prefetched in
    registers (num_stages 1) or streamed by TMA through a ring of 2-4 stages (128- and 64-byte swizzles: K tiles
    of 256 and 128), register caps (one for the down kernel alone: the decode default), and the activations
    prefetched with the K loop unrolled by two (mode 2, `gl_act_ahead`: four K tiles over D and I, so the
    unrolled loop runs twice), and kernels with fields of their own (`mx_kernels`: the up kernel's register
    stream of 128-wide K tiles beside the down kernel's TMA ring of 256). A ring of 3 or more stages gets twice
    its stages' K tiles, so that every stage is refilled and every mbarrier phase flips (`gl_ring_refill`; the
    H100 SXM's own decode config, `MX_DECODE_BY_DEVICE`, among them; and 16-token tiles on a 4-stage down ring)."""
    (_, bk1, _, s1, _), (_, bk2, _, s2, _) = mx_kernels(mx_config)
    D, I = (4 * bk1, 4 * bk2) if len(mx_config) > 7 else (512 if bk1 == 256 else 256, 256)
    D, I = (max(D, 2 * s1 * bk1) if s1 > 2 else D), (max(I, 2 * s2 * bk2) if s2 > 2 else I)
    assert gluon_decode_ok(mx_config, D, I, mx_block_k(D, bk1), mx_block_k(I, bk2))
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _bf16_case(2, N, 4, 6, D, I)
    y, y_triton = torch.full_like(z, float("nan")), torch.full_like(z, float("nan"))
    moe.launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y, mx_config=mx_config, **attrs)
    moe.launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y_triton, mx_config=mx_config, gluon=False,
                           **attrs)
    assert torch.equal(y.view(torch.int16), y_triton.view(torch.int16))
    (want,) = get_op("moe_experts").ref({**attrs, "weight_format": "mxfp4"},
                                        *(t.cpu() for t in (z.float(), wt, ids, w1, w3, w2, s1, s3, s2)))
    err = ((y.float().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-2, err


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mx_config", [(8, 32, 256, 2, 2, False, (None, 80)),
                                       (8, 32, 256, 2, (4, 2), False, (None, 80), (1, 0)),
                                       (8, 32, 256, 2, 1, False, None), (8, 32, 512, 2, 1, True, None),
                                       (8, 16, 128, 1, 3, True, None), (16, 32, 256, 2, 2, False, 96),
                                       (8, 32, 128, 2, 2, False, None, (2, 2)), (8, 64, 256, 2, 3, False, None),
                                       (8, 32, 256, 2, 2, False, (None, 80), (2, 0))])
@pytest.mark.parametrize("N", [1, 12])
def test_tiled_words_match_row_major_on_gpu(N, mx_config):
    """bf16 on the GPU: the Gluon kernels (TMA ring of 2-4 stages over the tiled view's boxes, 16- and 32-row
    blocks, 128-wide K tiles: half a tile's row; the register word stream by `mx_word_offset`, K tiles of 256 and
    512: two tiles' rows a K tile) and the Triton kernels (`mxfp4_tile_bf16`'s tiled addressing) over the words'
    tiled copies (`mx_tile_words`; `mx_tile_bits`, whose placed bits the PTX of `mxfp4_word_bf16`'s BITS
    decodes) equal, bitwise, the same kernels over the row-major words. D and I give every ring twice its
    stages' K tiles and two 32-row blocks an expert."""
    D, I = 2048, 1024
    z, wt, ids, (w1, w3, w2, s1, s3, s2), attrs = _bf16_case(5, N, 4, 6, D, I)
    for code, relay in ((1, mx_tile_words), (2, mx_tile_bits)):
        tiled = [relay(w) for w in (w1, w3, w2)]
        for gluon in (None, False):
            y, y_tiled = torch.full_like(z, float("nan")), torch.full_like(z, float("nan"))
            moe.launch_moe_experts(z, wt, ids, w1, w3, w2, s1, s3, s2, y=y, mx_config=mx_config, gluon=gluon,
                                   **attrs)
            moe.launch_moe_experts(z, wt, ids, *tiled, s1, s3, s2, y=y_tiled, mx_config=mx_config, gluon=gluon,
                                   tiled=code, **attrs)
            assert not y.isnan().any() and torch.equal(y.view(torch.int16), y_tiled.view(torch.int16)), (code, gluon)
