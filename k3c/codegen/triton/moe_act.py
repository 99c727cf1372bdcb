"""What the MoE expert kernels share (dense `moe.py`, MXFP4 `moe_mxfp4.py`): the tile prologue over the sorted
rows of one expert, and the gated activations (K3-SPEC.md "MLP and Stable LatentMoE"; exact semantics:
`moe_experts_ref` in k3c/ir/ops/model_moe.py). Plain `@triton.jit` helpers a generator pastes into its modules."""

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


@triton.jit
def expert_tile(tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, tile, BLOCK_M: tl.constexpr):
    """The rows of tile `tile` of the `moe_schedule` (tokens sorted by expert, BLOCK_M rows a tile): its expert e
    (E for an unused tile), the sorted-row offsets [BLOCK_M] and their mask, and each row's flat (token · K + slot)
    index from `order` (0 where masked)."""
    e = tl.load(tile_expert_ptr + tile)
    offs_m = tl.load(tile_row0_ptr + tile) + tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.load(tile_row_end_ptr + tile)
    slot = tl.load(order_ptr + offs_m, mask=m_ok, other=0)
    return e, offs_m, m_ok, slot
