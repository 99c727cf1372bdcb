"""The gated activations of the MoE expert kernels (K3-SPEC.md "MLP and Stable LatentMoE"; exact semantics:
`moe_experts_ref` in k3c/ir/ops/model_moe.py), plain `@triton.jit` helpers a generator pastes into its modules."""

import triton
import triton.language as tl


@triton.jit
def tanh_f32(x):
    """tanh in fp32 without cancellation (Triton has no portable tanh): odd Taylor polynomial for |x| < 1/8,
    else (1 − e^−2|x|) / (1 + e^−2|x|)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = a * a
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(x < 0, -1.0, 1.0) * tl.where(a < 0.125, small, big)


@triton.jit
def glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU: tl.constexpr):
    """fp32 act(gate, up), elementwise: SiTU-GLU β·tanh(g/β)·σ(g) · β_l·tanh(u/β_l) (config
    activation_situ_beta, activation_situ_linear_beta) with ACT_SITU, else SwiGLU g·σ(g)·u."""
    if ACT_SITU:
        h = SITU_BETA * tanh_f32(gate / SITU_BETA) * tl.sigmoid(gate) * (SITU_LINEAR_BETA *
                                                                        tanh_f32(up / SITU_LINEAR_BETA))
    else:
        h = gate * tl.sigmoid(gate) * up
    return h
