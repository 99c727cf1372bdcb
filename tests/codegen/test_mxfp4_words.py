"""The MXFP4 words' decoding (k3c.codegen.triton.moe_mxfp4) and load-time layouts (k3c.runtime.layouts): the
portable fp32 decoding against the IR's `mxfp4_dequantize`, the inline PTX (interpreted here, run on a GPU) against
the portable decoding, bitwise, over the checkpoint's bit order, the `mxfp4_tiles` tiles and the
`mxfp4_tiles_bits` placed bits."""

import inspect
import re

import pytest
import torch
import triton
import triton.language as tl

from k3c.codegen.triton.moe_mxfp4 import mx_permute, mxfp4_scales, mxfp4_weight_tile, mxfp4_word_bf16
from k3c.ir.formats import mxfp4_dequantize
from k3c.runtime.layouts import mx_place_bits, mx_tile_bits, mx_tile_words

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, R: tl.constexpr, KDIM: tl.constexpr, BLOCK_K: tl.constexpr,
                   FAST: tl.constexpr, TWO_MULS: tl.constexpr, V2: tl.constexpr, TILED: tl.constexpr):
    rows = tl.arange(0, R).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    for k0 in range(0, KDIM, BLOCK_K):
        s = mxfp4_scales(s_ptr, rows, rows < R, k0, KDIM, BLOCK_K, FAST, V2)
        w = mxfp4_weight_tile(w_ptr, s, rows, rows < R, k0, KDIM, BLOCK_K, FAST, TWO_MULS, V2, TILED)
        tl.store(out_ptr + rows[:, None] * KDIM + k0 + offs[None, :], w.to(out_ptr.dtype.element_ty))


def random_mxfp4(R, KDIM, smax, dev):
    """Packed [R, KDIM/2] with every byte value in row 0, scales [R, KDIM/32] ≤ smax: mostly 2^-27..2^1, rows
    1..3 any E8M0 ≤ smax, row 4 starting with 0, 1, smax."""
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randint(0, 256, (R, KDIM // 2), dtype=torch.uint8, device=dev, generator=gen)
    w[0, :256] = torch.arange(256, dtype=torch.uint8)
    s = torch.randint(100, 129, (R, KDIM // 32), dtype=torch.uint8, device=dev, generator=gen)
    s[1:4].random_(0, smax + 1, generator=gen)
    s[4, :3] = torch.tensor([0, 1, smax])
    return w, s


def dequantized(w, s, dtype, v2=False):
    """The IR's `mxfp4_dequantize` on the CPU (exact there; torch.exp2 on a GPU is not for 2^-127), in the kernels'
    K order (v2: the `mma.sync` one), on w's device."""
    return mx_permute(mxfp4_dequantize(w.cpu(), s.cpu()).to(dtype), 256, v2=v2).to(w.device)


def decode(w, s, dtype, fast, two_muls, v2=False, bk=256, tiled=0):
    """The decoded [R, KDIM] of packed w [R, KDIM/2] (row-major; tiled 1 / 2: decoded from its `mx_tile_words` /
    `mx_tile_bits` copy)."""
    R, KDIM = w.shape[0], 2 * w.shape[1]
    out = torch.empty(R, KDIM, dtype=dtype, device=w.device)
    words = (w if not tiled else mx_tile_words(w[None])[0] if tiled == 1 else mx_tile_bits(w[None])[0])
    _decode_kernel[(1,)](words.view(torch.int32), s, out, R=R, KDIM=KDIM, BLOCK_K=bk, FAST=fast, TWO_MULS=two_muls,
                         V2=v2, TILED=tiled)
    return out


@pytest.mark.parametrize("v2", [False, True])
def test_portable_decoding_equals_dequantize(v2):
    """The fp32 decoding (interpreter / fp32 activations): every byte value, E8M0 0 (2^-127) and 255 (NaN),
    equal to the IR's `mxfp4_dequantize` in the kernels' K order (wgmma's and mma.sync's); the same from the
    words' tiled copies (`mx_tile_words`, 32 rows by two 256-value tiles, and `mx_tile_bits`, the tiles with
    each word's bits placed) with K tiles of 512, 256 and 128."""
    w, s = random_mxfp4(64 if v2 else 8, 512, 255, "cuda" if torch.cuda.is_available() else "cpu")
    want = dequantized(w, s, torch.float32, v2)
    torch.testing.assert_close(decode(w, s, torch.float32, False, False, v2), want, rtol=0, atol=0, equal_nan=True)
    if v2:
        for bk in (512, 256, 128):
            row_major = decode(w, s, torch.float32, False, False, v2, bk=bk).view(torch.int32)
            for tiled in (1, 2):
                got = decode(w, s, torch.float32, False, False, v2, bk=bk, tiled=tiled)
                assert torch.equal(got.view(torch.int32), row_major), (bk, tiled)


def ptx_pairs(asm: str, word: int) -> tuple[list[int], int]:
    """(the four bf16 pair registers `asm` (a `mxfp4_word_bf16` body) writes to its outputs ($0, $1) .. ($6, $7)
    for the 32-bit word with every multiplier 1, its integer instruction count), from a small interpreter of the
    PTX it may use (and, shl, shr, shf.r.wrap, lop3 with an immediate LUT; mul.bf16x2 by a multiplier of 1 keeps
    its operand; mov.b32 {$a, $b}, t writes the outputs)."""
    regs, slots, mask, integer = {"$8": word}, {}, 0xFFFFFFFF, 0

    def val(x):
        return int(x, 0) if x[0].isdigit() else regs[x]

    for ins in (i.strip() for i in asm.replace("\n", " ").split(";")):
        op, _, rest = ins.partition(" ")
        a = [x.strip() for x in rest.split(",")]
        integer += op in ("and.b32", "shl.b32", "shr.b32", "shf.r.wrap.b32", "lop3.b32")
        if op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << val(a[2])) & mask
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> val(a[2])
        elif op == "shf.r.wrap.b32":
            v, k = val(a[1]) | val(a[2]) << 32, val(a[3]) % 32
            regs[a[0]] = (v >> k) & mask
        elif op == "lop3.b32":
            x, y, z, lut = (val(v) for v in a[1:5])
            regs[a[0]] = sum(((lut >> ((x >> i & 1) << 2 | (y >> i & 1) << 1 | (z >> i & 1))) & 1) << i
                             for i in range(32))
        elif op == "mul.bf16x2":
            regs[a[0]] = regs[a[1]]
        elif op == "mov.b32" and rest.startswith("{$"):      # mov.b32 {$a, $b}, t: the pair's two bf16 outputs
            lo, hi = (int(x.strip(" {}$")) for x in rest.split("}")[0].split(","))
            slots[lo], slots[hi] = regs[a[-1]] & 0xFFFF, regs[a[-1]] >> 16
        elif op and not op.startswith(("mov", "{", ".reg", "}")):
            raise AssertionError(f"instruction {op} not modelled")
    assert sorted(slots) == list(range(8))
    return [slots[2 * j] | slots[2 * j + 1] << 16 for j in range(4)], integer


@pytest.mark.parametrize("two_muls", [False, True])
def test_placed_bits_decode_to_the_bf16_pattern(two_muls):
    """The PTX of `mxfp4_word_bf16` (interpreted instruction by instruction, `ptx_pairs`) turns every word into its
    four bf16 pairs, outputs ($0, $1) .. ($6, $7): pair j holds code j (em at bits 6..8, sign at 15) and code
    j + 4 (16 bits up), as the checkpoint's word held them at bits 4c .. 4c + 3; with BITS from the word's
    `mxfp4_tiles_bits` placement (`mx_place_bits`) in 9 integer instructions, without from the checkpoint's order
    in 11. A few placements worked out by hand from the layout's rule, and `mx_tile_bits` = the tiles' words,
    each placed."""
    src = inspect.getsource(mxfp4_word_bf16.fn)
    bodies = re.findall(r'"""\{(.*?)\}"""', src, re.S)
    placed_asm = [b for b in bodies if "shf.r.wrap" in b]
    plain_asm = [b for b in bodies if "shf.r.wrap" not in b]
    assert len(placed_asm) == len(plain_asm) == 2
    asm, plain = (placed_asm[0], plain_asm[0]) if two_muls else (placed_asm[1], plain_asm[1])
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (64, 4), dtype=torch.uint8, generator=gen)
    raw[:16] = torch.arange(16, dtype=torch.uint8)[:, None] * 17        # every code in every nibble
    placed = mx_place_bits(raw).view(torch.int32)[:, 0].tolist()
    for word, got in zip(raw.view(torch.int32)[:, 0].tolist(), placed):
        codes = [(word & 0xFFFFFFFF) >> (4 * c) & 15 for c in range(8)]
        want = [(codes[j] & 7) << 6 | (codes[j] >> 3) << 15 | (codes[j + 4] & 7) << 22 | (codes[j + 4] >> 3) << 31
                for j in range(4)]
        assert ptx_pairs(asm, got & 0xFFFFFFFF) == (want, 9), hex(word)
        assert ptx_pairs(plain, word & 0xFFFFFFFF) == (want, 11), hex(word)
    # by hand: code 0's mantissa stays at 6 (pair 0: w & P); code 1's moves to 10 (pair 1: rotr(w, 4)), code 2's to
    # 0 (pair 2: w << 6), code 3's to 4 and its top exponent bit (word bit 14) stays at 14 (pair 3: w << 2, w >> 6);
    # the signs of codes 5, 6 and 7 (p = 31) go to 3, 25 and 29
    by_hand = {0x1: 1 << 6, 0x10: 1 << 10, 0x100: 1 << 0, 0x1000: 1 << 4, 0x4000: 1 << 14, 0x00800000: 1 << 3,
               0x08000000: 1 << 25, 0x80000000: 1 << 29, 0xFFFFFFFF: 0xFFFFFFFF, 0: 0}
    words = torch.tensor([w - (1 << 32) if w >> 31 else w for w in by_hand], dtype=torch.int32)
    got = [w & 0xFFFFFFFF for w in mx_place_bits(words.view(torch.uint8)).view(torch.int32).tolist()]
    assert got == list(by_hand.values())
    w = torch.randint(0, 256, (2, 64, 512), dtype=torch.uint8, generator=gen)
    t, b = mx_tile_words(w), mx_tile_bits(w)
    assert t.shape == b.shape and torch.equal(mx_place_bits(t.reshape(-1, 4)).reshape(b.shape), b)


def test_tiled_word_layout():
    """`mx_tile_words` puts word wk of global row r (e·R + r) at `mx_word_offset(r, wk, KW, True)`, which a plain
    reading of the layout gives: [32 rows, 32 words] tiles along K, then 32-row block by block (every word of
    the tensor checked); shapes that are not whole tiles raise ValueError naming the shape."""
    E, R, K = 2, 64, 768
    w = torch.randint(0, 256, (E, R, K // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = mx_tile_words(w)
    assert t.shape == w.shape and t.is_contiguous()
    words, tiled = w.view(torch.int32).reshape(E * R, K // 8), t.view(torch.int32).reshape(-1)
    KW = K // 8
    for r in (0, 1, 31, 32, 63, 64, 95, 127):
        for wk in (0, 1, 31, 32, 33, 63, 64, 95):
            block, piece = r // 32, wk // 32
            at = (block * (KW // 32) + piece) * 1024 + (r % 32) * 32 + wk % 32
            assert tiled[at] == words[r, wk], (r, wk)
    rows = torch.arange(E * R)[:, None]
    wk = torch.arange(KW)[None, :]
    at = ((rows // 32) * (KW // 32) + wk // 32) * 1024 + (rows % 32) * 32 + wk % 32
    assert torch.equal(tiled[at], words)
    with pytest.raises(ValueError, match=r"MXFP4 words \[2, 48, 384\]: the tiled layout needs rows a multiple of 32"):
        mx_tile_words(w[:, :48].contiguous())
    with pytest.raises(ValueError, match="K a multiple of 256"):
        mx_tile_words(w[:, :, :64].contiguous())
    with pytest.raises(ValueError, match=r"MXFP4 words torch.uint8\[64, 384\]: expected u8 \[E, R, K/2\]"):
        mx_tile_bits(w[0])
    with pytest.raises(ValueError, match=r"MXFP4 words torch.int32\[4\]: expected u8 \[\.\.\., 4n\]"):
        mx_place_bits(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"MXFP4 words torch.uint8\[2, 6\]: expected u8"):
        mx_place_bits(torch.zeros(2, 6, dtype=torch.uint8))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("two_muls", [False, True])
def test_word_decoding_equals_portable(two_muls, v2):
    """Every byte value with every scale the variant handles (TWO_MULS: all E8M0 but NaN; else ≤ 128): the PTX
    decoding, the portable one (fp32, rounded to bf16: exact) and the IR's `mxfp4_dequantize` agree bitwise, in
    both K orders."""
    w, s = random_mxfp4(64, 512, 254 if two_muls else 128, "cuda")
    want = dequantized(w, s, torch.bfloat16, v2).view(torch.int16)
    assert torch.equal(decode(w, s, torch.bfloat16, False, two_muls, v2).view(torch.int16), want)
    assert torch.equal(decode(w, s, torch.bfloat16, True, two_muls, v2).view(torch.int16), want)
    if v2:      # the words in `mxfp4_tiles_bits` (64 rows, two tiles a row): the placed bits' PTX decoding
        assert torch.equal(decode(w, s, torch.bfloat16, True, two_muls, v2, tiled=2).view(torch.int16), want)
