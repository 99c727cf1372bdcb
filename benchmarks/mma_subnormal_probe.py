"""Probe (GPU): do the tensor cores keep bf16 and f16 subnormal inputs, or flush them to zero?

Run Q (BENCHMARKS.md "MXFP4 round, run Q") left this open: the MXFP4 decoding places a code's bits so that the bf16
pattern is code · 2^-126 (codes 1 and 0 below the smallest normal, 2^-126) and then multiplies every pair by the
scale · 2^126 (`mul.bf16x2`). Applying the scale to each 32-value group's fp32 partial instead would feed the
tensor cores those raw patterns, subnormals included, so it needs the MMA to multiply subnormal inputs exactly.

A [M, 64] operand holds the bf16 (f16) subnormals 2^-133..2^-127 (2^-24..2^-15) and 0.75 of the smallest normal,
both signs, in its first 16 columns; B [64, 16] is 2^100 (2^10) on its diagonal and zero elsewhere, so each output
c[i, j] is the one product a[i, j] · B[j, j], exact in fp32. Both are multiplied by `tl.dot` (Triton picks `mma.sync` for M = 16
and `wgmma` for M = 64 on sm_90) and the result compared with the exact products computed on the host in float64.

    python3 benchmarks/mma_subnormal_probe.py          # prints one line per dtype and M: exact / flushed
"""

import torch
import triton
import triton.language as tl


@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """c[M, N] fp32 = a[M, K] @ b[K, N], one program, one `tl.dot` (inputs in their own dtype)."""
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


def probe(dtype, M, dev="cuda"):
    """(exact, flushed, total) over the outputs whose input is subnormal: how many came back exact, how many 0."""
    low, top = (-133, -127) if dtype == torch.bfloat16 else (-24, -15)
    big = 100 if dtype == torch.bfloat16 else 10
    K, N = 64, 16
    mags = [2.0 ** e for e in range(low, top + 1)] + [1.5 * 2.0 ** top]
    vals = torch.tensor([s * m for m in mags for s in (1, -1)], dtype=torch.float64)
    a = torch.zeros(M, K, dtype=torch.float64)
    for i in range(M):
        for j in range(N):
            a[i, j] = vals[(i * N + j) % len(vals)]
    b = torch.zeros(K, N, dtype=torch.float64)
    b[torch.arange(N), torch.arange(N)] = 2.0 ** big    # c[i, j] = a[i, j] · 2^big: one exact product an output
    assert torch.equal(a.to(dtype).double(), a), "the inputs must be representable"
    want = a @ b
    c = torch.empty(M, N, dtype=torch.float32, device=dev)
    dot_kernel[(1,)](a.to(dtype).to(dev), b.to(dtype).to(dev), c, M=M, N=N, K=K)
    got = c.double().cpu()
    sub = ((a.abs() > 0) & (a.abs() < 2.0 ** (top + 1)))[:, :N]
    exact = int((got == want)[sub].sum())
    flushed = int(((got == 0) & (want != 0))[sub].sum())
    return exact, flushed, int(sub.sum())


def main():
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for dtype in (torch.bfloat16, torch.float16):
        for M in (16, 64):
            exact, flushed, total = probe(dtype, M)
            print(f"{str(dtype):15s} M {M:3d}: {exact}/{total} outputs exact, {flushed} flushed to zero")


if __name__ == "__main__":
    main()
