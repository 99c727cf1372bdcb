"""Triton kernels and emitters for the MoE ops `moe_route` and `moe_experts`.

Math: K3-SPEC.md "MLP and Stable LatentMoE" (router: DeepSeek-V3 §2.1.2); exact semantics: `moe_route_ref` and
`moe_experts_ref` of k3c/ir/ops/model_moe.py.

moe_route: `moe_route_kernel`, one program per token row: s = sigmoid(logits) in fp32; top_k rounds of
  (max of s + bias, lowest expert id among the maxima, knock it out) = the reference's stable descending sort;
  weights = s[chosen] / (Σ s[chosen] + 1e-20) · scaling (the bias only chooses).
moe_experts: grouped expert GEMMs over tokens sorted by expert, deterministic (no atomics):
  1. `moe_schedule` (k3c.codegen.triton.moe_schedule; no host sync; one `moe_schedule_kernel` launch for
     decode's few rows, torch for prefill): the (token, slot) pairs are stably sorted by expert id (slots with
     id < 0 last, never computed) and cut into tiles of BLOCK_M rows of one expert; the grid is the upper bound
     min(N·k, ⌈N·k / BLOCK_M⌉ + E) tiles, tiles past the schedule exit at once;
  2. `moe_up_kernel` (tile, BLOCK_I columns of the intermediate): h = act(z W1ᵀ, z W3ᵀ) into a scratch
     [N·k, I] in z's dtype (SiTU-GLU or SwiGLU);
  3. `moe_down_kernel` (tile, BLOCK_N output columns): y_slot[(token, slot)] = (h W2ᵀ) · weight into an f32
     scratch [N·k, D];
  4. `moe_sum_kernel` (token, BLOCK_N columns): y = Σ over the token's slots with id ≥ 0, in slot order.
  MXFP4 experts (weight_format "mxfp4", k3c.ir.formats): steps 2 and 3 are `moe_up_mx_kernel` /
  `moe_down_mx_kernel` (k3c.codegen.triton.moe_mxfp4), which read the packed E2M1 words and E8M0 scales and
  decode each weight tile in registers straight into the MMA, so HBM carries 4.25 bits per weight; decode (few
  rows per expert: BLOCK_M = 16) streams the packed weights, prefill (BLOCK_M = 128) feeds the tensor cores.
  With bf16 activations on a GPU, 8- and 16-token decode tiles on 1-2 warps run the Gluon versions
  (k3c.codegen.triton.moe_mxfp4_gluon: num_stages 1 prefetches the next K tile's words in registers, ≥ 2 streams
  them through a TMA ring in shared memory; `gluon_decode_ok`), and from 8 rows per expert the `wgmma` ones
  (k3c.codegen.triton.moe_mxfp4_wgmma: 16-token tiles, `wgmma_decode_ok`). Where D and I are multiples of 256
  (K3, K3.1 Pro, Kimi Linear) the artifact asks the runtime to re-lay the packed words at load in 4 KB tiles,
  each word's bits placed for the decoding (`moe_experts_layouts`: the `mxfp4_tiles_bits` layout of
  k3c.runtime.layouts), and every kernel addresses and decodes them so (`mx_word_offset`, `mx_word_code`,
  `mxfp4_word_bf16`; the emitted module's TILED_WORDS): a decode CTA then reads its rows in address order, 9
  integer instructions a word.
  Two GEMM kernels rather than one: a single fused act(z W1ᵀ, z W3ᵀ) W2ᵀ program would have to either hold all
  of D in registers or recompute h per output block (re-reading W1/W3 D/BLOCK_N times); split, every expert
  weight is read once per token tile and the grid covers I and D, which decode (few tokens) needs to fill the GPU.

Public API: `emit_moe_route(group)`, `emit_moe_experts(group)` -> module text (registered with
`k3c.codegen.triton.emitter`), `moe_experts_layouts(group)` (registered with `weight_layout`); launchers
`launch_moe_route`, `launch_moe_experts` (copied into the emitted modules) and the kernels.
"""

from __future__ import annotations


import sympy
import torch
import triton
import triton.language as tl

from k3c.codegen.backend import ScratchSpec
from k3c.codegen.triton import emitter, model_module, one_node, scratch, take_scratch, weight_layout
from k3c.codegen.triton.gl_common import (gl_barrier_named, gl_reinterpret, gl_reinterpret_named, gl_thread_barrier,
                                         gl_tma_load, gl_tma_load_named)
from k3c.codegen.triton.moe_act import expert_tile, glu, tanh_f32
from k3c.codegen.triton.moe_mxfp4 import (MX_DECODE_BY_DEVICE, ONE_MUL_MAX_SCALE, moe_down_mx_kernel, moe_up_mx_kernel,
                                         mx_act_tile, mx_block_k, mx_default_config, mx_even_unroll, mx_kernels,
                                         mx_mma_v2, mx_permute, mx_permuted_col, mx_word_code, mx_word_offset,
                                         mxfp4_scale_bf16, mxfp4_scales, mxfp4_tile_bf16, mxfp4_tile_f32,
                                         mxfp4_weight_tile, mxfp4_word_bf16)
from k3c.codegen.triton.gl_ring import (gl_ring_fill, gl_ring_init, gl_ring_refill, gl_stage_words, gl_word_descs,
                                       gl_words2d_layout)
from k3c.codegen.triton.moe_schedule import (SCHEDULE_KERNEL_MAX_ROWS, _max_i32, moe_schedule,
                                            moe_schedule_kernel, schedule_tiles)
from k3c.codegen.triton.moe_mxfp4_gluon import (GLUON_BLOCK_MS, gl_act_ahead, gl_act_offsets, gl_act_operand,
                                               gl_axis_layout, gl_decoded_tile, gl_layouts, gl_permute,
                                               gl_permuted_col, gl_tile_rows, gl_word_offsets, gl_word_values_operand,
                                               gluon_decode_ok, moe_down_mx_gluon_kernel, moe_up_mx_gluon_kernel)
from k3c.codegen.triton.moe_mxfp4_fused import (moe_mx_wgmma_fused_kernel, mx_wgmma_launches, wg_proxy_fence,
                                               wg_wait_count)
from k3c.codegen.triton.moe_mxfp4_wgmma import (WG_ACT_MODES, WG_BLOCK_MS, WG_FUSED_MODES, moe_down_mx_wgmma_kernel,
                                                moe_up_mx_wgmma_kernel, wg_cta_rows, wg_decoded_tile, wg_down_item,
                                                wg_down_step, wg_down_tile, wg_gather_kernel, wg_layouts, wg_mma_piece,
                                                wg_narrow, wg_opaque, wg_permuted_col, wg_scale_offsets, wg_scale_pair,
                                                wg_stage_piece, wg_tile_rows, wg_up_item, wg_up_step, wg_up_tile,
                                                wgmma_decode_ok)
from k3c.codegen.triton.wg_ring import (WG_BLOCK_K, WG_ROWS, wg_act_desc, wg_pair_desc, wg_ring_fill, wg_stage_layouts,
                                        wg_word_desc)
from k3c.ir.kernels import KernelGroup
from k3c.ir.types import TensorType
from k3c.runtime.layouts import MX_TILE_K, MX_TILE_ROWS, mx_tiles_ok


@triton.jit
def moe_route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, SCALING, logits_rs, E: tl.constexpr, K: tl.constexpr,
                     RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token row: logits f32 [N, E] (rows `logits_rs` apart: a column view of a fused GEMM reads in place),
    bias [E] -> weights f32 [N, K], ids i64 [N, K]."""
    n = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    s = tl.sigmoid(tl.load(logits_ptr + n * logits_rs + offs_e, mask=e_ok, other=0.0))
    choice = tl.where(e_ok, s + tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32), float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    p = tl.zeros([BLOCK_K], tl.float32)
    for i in tl.static_range(K):
        best = tl.max(choice, 0)
        e_i = tl.min(tl.where(choice == best, offs_e, BLOCK_E), 0)     # ties: lowest expert id
        ids = tl.where(offs_k == i, e_i, ids)
        p = tl.where(offs_k == i, tl.sum(tl.where(offs_e == e_i, s, 0.0), 0), p)
        choice = tl.where(offs_e == e_i, float("-inf"), choice)
    if RENORMALIZE:
        p = p / (tl.sum(p, 0) + 1e-20)
    tl.store(w_ptr + n * K + offs_k, p * SCALING, mask=offs_k < K)
    tl.store(ids_ptr + n * K + offs_k, ids.to(tl.int64), mask=offs_k < K)


def launch_moe_route(logits, bias, weights, ids, *, top_k, scaling, renormalize):
    """logits f32 [N, E] (rows of unit stride may lie any stride apart: read in place), bias [E] -> weights f32
    [N, top_k], ids i64 [N, top_k]. Raises ValueError on shapes."""
    N, E = logits.shape
    if bias.numel() != E or tuple(weights.shape) != (N, top_k) or tuple(ids.shape) != (N, top_k):
        raise ValueError(f"moe_route: logits {tuple(logits.shape)}, bias {tuple(bias.shape)}, outputs "
                         f"{tuple(weights.shape)} / {tuple(ids.shape)} mismatch")
    if logits.stride(-1) != 1 and E > 1:
        logits = logits.contiguous()
    bias = bias.contiguous()
    if N:
        moe_route_kernel[(N,)](logits, bias, weights, ids, float(scaling), logits.stride(0), E=E, K=top_k,
                               RENORMALIZE=renormalize,
                               BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k))


@triton.jit
def moe_up_kernel(z_ptr, w1_ptr, w3_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, h_ptr, SITU_BETA,
                  SITU_LINEAR_BETA, z_rs, E: tl.constexpr, K: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                  ACT_SITU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """h[row, i] = act(z W1[e]ᵀ, z W3[e]ᵀ) for the sorted rows of one tile (z [N, D], rows `z_rs` apart, dense
    w1/w3 [E, I, D])."""
    e, offs_m, m_ok, slot = expert_tile(tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, tl.program_id(0),
                                        BLOCK_M)
    if e < E:
        token = slot // K
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        rows = e.to(tl.int64) * I + offs_i
        gate = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            z = tl.load(z_ptr + token[:, None] * z_rs + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            wmask = d_ok[:, None] & i_ok[None, :]
            w1 = tl.load(w1_ptr + rows[None, :] * D + offs_d[:, None], mask=wmask, other=0.0)
            w3 = tl.load(w3_ptr + rows[None, :] * D + offs_d[:, None], mask=wmask, other=0.0)
            gate += tl.dot(z, w1, input_precision=DOT_PRECISION)
            up += tl.dot(z, w3, input_precision=DOT_PRECISION)
        h = glu(gate, up, SITU_BETA, SITU_LINEAR_BETA, ACT_SITU)
        tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_i[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & i_ok[None, :])


@triton.jit
def moe_down_kernel(h_ptr, w2_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, y_slot_ptr,
                    E: tl.constexpr, D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_I: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y_slot[(token, slot)] = (h W2[e]ᵀ) · weight for one tile and BLOCK_N output columns (dense w2 [E, D, I])."""
    e, offs_m, m_ok, slot = expert_tile(tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, tl.program_id(0),
                                        BLOCK_M)
    if e < E:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        rows = e.to(tl.int64) * D + offs_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i0 in range(0, I, BLOCK_I):
            offs_i = i0 + tl.arange(0, BLOCK_I)
            i_ok = offs_i < I
            h = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_i[None, :], mask=m_ok[:, None] & i_ok[None, :],
                        other=0.0)
            w2 = tl.load(w2_ptr + rows[None, :] * I + offs_i[:, None], mask=i_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.dot(h, w2, input_precision=DOT_PRECISION)
        weight = tl.load(weights_ptr + slot, mask=m_ok, other=0.0)
        tl.store(y_slot_ptr + slot[:, None] * D + offs_n[None, :], acc * weight[:, None],
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_sum_kernel(y_slot_ptr, ids_ptr, y_ptr, K: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[n] = Σ_j y_slot[n·K + j] over the slots j with ids[n, j] ≥ 0 (unused slots are never read)."""
    n = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(K):
        used = tl.load(ids_ptr + n * K + j + 0 * offs_n) >= 0      # the slot's id, broadcast to the lanes
        acc += tl.load(y_slot_ptr + (n * K + j) * D + offs_n, mask=n_ok & used, other=0.0)
    tl.store(y_ptr + n * D + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def launch_moe_experts(z, weights, ids, w1, w3, w2, *scales, y, act, situ_beta, situ_linear_beta,
                       blocks=None, schedule=None, mx_config=None, scratch=None, scale_max=255, gluon=None,
                       tiled=False):
    """z [N, D] (unit-stride rows any stride apart: read in place), weights f32 [N, k], ids int [N, k] (< 0: unused),
    w1/w3 [E, I, D], w2 [E, D, I] -> y [N, D].

    MXFP4 weights (k3c.ir.formats): w1/w3 u8 [E, I, D/2], w2 u8 [E, D, I/2] and `scales` (w1, w3, w2 scales:
    u8 [E, I, D/32], [E, I, D/32], [E, D, I/32]), decoded in registers by `moe_up_mx_kernel` /
    `moe_down_mx_kernel` (k3c.codegen.triton.moe_mxfp4: bf16 z on the GPU, 8 codes per 32-bit word in inline PTX;
    f32 z anywhere), dots in z's dtype with fp32 accumulation. Scratch: h [N·k, I] in z's dtype, y_slot f32
    [N·k, D] and, MXFP4, z_perm [N, D] (z in the kernels' K order); where the `wgmma` decode kernels of
    k3c.codegen.triton.moe_mxfp4_wgmma can run (`mx_wgmma_rows`; selected by mx_config's activation modes
    (3, 3), or (4, 4) for their one-launch form), h has their tile rows if more, zs holds z gathered in them and
    wg_flags the one-launch form's counters: the planned buffers of `scratch` (name ->
    tensor, `moe_experts_scratch`), else allocated here; the sort permutation and tile schedule (i64, O(N·k + E))
    are allocated here. Benchmarks may pass `blocks` (dense: BLOCK_M, BLOCK_I, BLOCK_D, BLOCK_N), `mx_config` (MXFP4:
    BLOCK_M, BLOCK_R, largest BLOCK_K, num_warps, num_stages, two_muls, maxnreg (None: no register cap);
    optionally the Gluon kernels' activation prefetch modes, `gl_act_ahead`; BLOCK_R, BLOCK_K, num_warps,
    num_stages and maxnreg each one value or an (up, down) pair, `mx_kernels`) and a
    precomputed `schedule` (`moe_schedule(ids, E, BLOCK_M)`). scale_max: an upper bound on the MXFP4 scale bytes
    (the node's `scale_max`, read from the checkpoint; 255: unknown), which picks the decoding
    (`mx_default_config`, given z's CUDA device name: a card may have its own decode config,
    `MX_DECODE_BY_DEVICE`). gluon: None runs the Gluon decode kernels (k3c.codegen.triton.moe_mxfp4_gluon) for bf16
    z on a GPU wherever `gluon_decode_ok` takes the configuration, False never (the Triton kernels; benchmarks).
    tiled: the MXFP4 words w1/w3/w2 in a load-time layout of the runtime (k3c.runtime.layouts; same shapes), its
    `MX_WORD_LAYOUTS` code: 0 / False the checkpoint's row-major order, 1 / True `mxfp4_tiles` (every kernel
    addresses them by `mx_word_offset`), 2 `mxfp4_tiles_bits` (the tiles with each word's bits placed for the
    decoding, `mx_word_code`, `mxfp4_word_bf16`'s BITS); 1 and 2 need D and I multiples of MX_TILE_K (256).
    Raises ValueError on mismatched shapes, a layout code outside 0..2, a layout given dense experts or a tiled
    layout the shapes cannot take.
    """
    N, D = z.shape
    E, I = w1.shape[:2]
    K = ids.shape[1]
    mx = len(scales) == 3
    p = 2 if mx else 1
    if tuple(w1.shape) != (E, I, D // p) or w3.shape != w1.shape or tuple(w2.shape) != (E, D, I // p) or \
            tuple(weights.shape) != (N, K) or ids.shape[0] != N or y.shape != z.shape or len(scales) not in (0, 3) \
            or (mx and [tuple(s.shape) for s in scales] != [(E, I, D // 32)] * 2 + [(E, D, I // 32)]) \
            or (mx and z.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"moe_experts: z {z.dtype}{list(z.shape)}, ids {list(ids.shape)}, w1 {list(w1.shape)}, "
                         f"w2 {list(w2.shape)}, {len(scales)} scales, y {list(y.shape)} mismatch "
                         "(MXFP4: z f32 or bf16)")
    if tiled not in (0, 1, 2):
        raise ValueError(f"moe_experts: tiled must be a word layout code 0, 1 or 2, got {tiled!r}")
    tiled = int(tiled)
    if tiled and not mx:
        raise ValueError(f"moe_experts: tiled={tiled} is a layout of MXFP4 words; these experts are dense")
    if tiled and not (mx_tiles_ok(I, D) and mx_tiles_ok(D, I)):
        raise ValueError(f"moe_experts: tiled MXFP4 words need D ({D}) and I ({I}) multiples of {MX_TILE_K}")
    if N == 0:
        return
    if z.stride(-1) != 1 and D > 1:  # unit-stride rows any stride apart (a fused GEMM's columns) are read in place
        z = z.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()
    rows = N * K
    precision = "ieee" if z.dtype == torch.float32 else "tf32"
    y_slot = take_scratch(scratch, "y_slot", (rows, D), torch.float32, z.device)
    wg_rows = mx_wgmma_rows(rows, E, D, I, scale_max, z.dtype == torch.bfloat16) if mx else 0
    h = take_scratch(scratch, "h", (max(rows, wg_rows), I), z.dtype, z.device)
    if mx:
        # the card's name only when the default is asked for (torch caches the device's properties)
        on_gpu = gluon is not False and z.dtype == torch.bfloat16 and z.is_cuda
        sm90 = on_gpu and torch.cuda.get_device_capability(z.device)[0] == 9       # the `wgmma` kernels' GPUs
        cfg = mx_config or mx_default_config(rows, E, scale_max,
                                             torch.cuda.get_device_name(z.device) if z.is_cuda else None,
                                             wgmma=sm90 and D % WG_BLOCK_K == 0 and I % WG_BLOCK_K == 0)
        (BR1, most1, *_), (BR2, most2, *_) = mx_kernels(cfg)
        BK1, BK2 = mx_block_k(D, most1), mx_block_k(I, most2)
        if mx_config is None:
            cfg = mx_even_unroll(cfg, D // BK1)
        BLOCK_M, two_muls = cfg[0], cfg[5]
        (BR1, most1, warps1, stages1, mr_up), (BR2, most2, warps2, stages2, mr_down) = mx_kernels(cfg)
        schedule = schedule or moe_schedule(ids, E, BLOCK_M)
        max_tiles = schedule[1].shape[0]
        fast = z.dtype == torch.bfloat16
        if sm90 and wgmma_decode_ok(cfg, D, I):
            need = max_tiles * BLOCK_M                   # tile rows (another mx_config than the planned one: here)
            zs = take_scratch(scratch, "zs", (wg_rows, D), z.dtype, z.device) if scratch is not None else \
                torch.empty(need, D, dtype=z.dtype, device=z.device)
            h = h if scratch is not None or h.shape[0] >= need else torch.empty(need, I, dtype=z.dtype, device=z.device)
            flags = take_scratch(scratch, "wg_flags", (wg_rows + 1,), torch.int32, z.device) if scratch is not None \
                else None
            for launch in mx_wgmma_launches(z, zs, schedule, w1, w3, w2, scales, h, y_slot, weights, mx_config=cfg,
                                            K=K, act=act, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                                            tiled=tiled, flags=flags):
                launch()
            moe_sum_kernel[(N, triton.cdiv(D, 256))](y_slot, ids, y, K=K, D=D, BLOCK_N=256)
            return
        gl_run = on_gpu and gluon_decode_ok(cfg, D, I, BK1, BK2)
        zp = take_scratch(scratch, "z_perm", (N, D), z.dtype, z.device)
        up_opts = dict(num_warps=warps1, **({"maxnreg": mr_up} if mr_up else {}))
        down_opts = dict(num_warps=warps2, **({"maxnreg": mr_down} if mr_down else {}))
        if gl_run:
            zp = gl_permute(z, BK1, out=zp)
            act_up, act_down = gl_act_ahead(cfg)
            # num_stages ≥ 2: the TMA ring, which takes the words by descriptor
            w1a, w3a = (gl_word_descs(w, BR1, BK1, tiled) if stages1 > 1 else w.view(torch.int32) for w in (w1, w3))
            w2a = gl_word_descs(w2, BR2, BK2, tiled) if stages2 > 1 else w2.view(torch.int32)
            moe_up_mx_gluon_kernel[(max_tiles, I // BR1)](
                zp.view(torch.int32), w1a, w3a, scales[0], scales[1], *schedule, h,
                float(situ_beta), float(situ_linear_beta), E=E, K=K, D=D, I=I, ACT_SITU=act == "situ",
                TWO_MULS=two_muls, BLOCK_M=BLOCK_M, BLOCK_R=BR1, BLOCK_D=BK1, BLOCK_K2=BK2,
                STAGES=stages1, ACT_AHEAD=act_up, TILED=tiled, **up_opts)
            moe_down_mx_gluon_kernel[(max_tiles, D // BR2)](
                h.view(torch.int32), w2a, scales[2], weights, *schedule, y_slot, E=E, D=D, I=I,
                TWO_MULS=two_muls, BLOCK_M=BLOCK_M, BLOCK_R=BR2, BLOCK_K2=BK2, STAGES=stages2,
                ACT_AHEAD=act_down, TILED=tiled, **down_opts)
            moe_sum_kernel[(N, triton.cdiv(D, 256))](y_slot, ids, y, K=K, D=D, BLOCK_N=256)
            return
        v2_up, v2_down = mx_mma_v2(warps1), mx_mma_v2(warps2)
        zp = mx_permute(z, BK1, out=zp, v2=v2_up)
        moe_up_mx_kernel[(max_tiles, triton.cdiv(I, BR1))](
            zp, w1.view(torch.int32), w3.view(torch.int32), scales[0], scales[1], *schedule, h,
            float(situ_beta), float(situ_linear_beta), E=E, K=K, D=D, I=I, ACT_SITU=act == "situ", FAST=fast,
            TWO_MULS=two_muls, BLOCK_M=BLOCK_M, BLOCK_R=BR1, BLOCK_D=BK1, BLOCK_K2=BK2,
            DOT_PRECISION=precision, V2=v2_up, V2_H=v2_down, TILED=tiled, num_stages=stages1, **up_opts)
        moe_down_mx_kernel[(max_tiles, triton.cdiv(D, BR2))](
            h, w2.view(torch.int32), scales[2], weights, *schedule, y_slot, E=E, D=D, I=I, FAST=fast,
            TWO_MULS=two_muls, BLOCK_M=BLOCK_M, BLOCK_R=BR2, BLOCK_K2=BK2, DOT_PRECISION=precision, V2=v2_down,
            TILED=tiled, num_stages=stages2, **down_opts)
    else:
        BLOCK_M, BLOCK_I, BLOCK_D, BLOCK_N = blocks or (16 if rows < 16 * E else 64, 64, 64, 64)
        schedule = schedule or moe_schedule(ids, E, BLOCK_M)
        max_tiles = schedule[1].shape[0]
        moe_up_kernel[(max_tiles, triton.cdiv(I, BLOCK_I))](
            z, w1, w3, *schedule, h, float(situ_beta), float(situ_linear_beta), z.stride(0), E=E, K=K, D=D, I=I,
            ACT_SITU=act == "situ", BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, BLOCK_D=BLOCK_D, DOT_PRECISION=precision)
        moe_down_kernel[(max_tiles, triton.cdiv(D, BLOCK_N))](
            h, w2, weights, *schedule, y_slot, E=E, D=D, I=I, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_I=BLOCK_I,
            DOT_PRECISION=precision)
    moe_sum_kernel[(N, triton.cdiv(D, 256))](y_slot, ids, y, K=K, D=D, BLOCK_N=256)


# ---- emitters --------------------------------------------------------------------------------------------------
SEMANTICS = "the op's `ref` in k3c/ir/ops/model_moe.py (K3-SPEC.md 'MLP and Stable LatentMoE')."


def _module(group, summary, consts, kernels, launcher, body):
    """The module text; it takes views (`TAKES_VIEWS`): the router logits and the experts' z are read in place."""
    return model_module(group, summary, __name__, SEMANTICS, consts, kernels, launcher, body, takes_views=True)


@emitter("moe_route")
def emit_moe_route(group: KernelGroup) -> str:
    """Module text for one `moe_route` node: inputs (logits, bias), outputs (weights, ids).
    Raises UnsupportedError for a group that is not a single moe_route node."""
    node, ip, op = one_node(group, "moe_route")
    a = node.attrs
    consts = [("TOP_K", int(a["top_k"]), "num_experts_per_token"),
              ("SCALING", float(a["scaling"]), "routed_scaling_factor"),
              ("RENORMALIZE", bool(a["renormalize"]), "weights / (sum of chosen + 1e-20)")]
    body = ("def launch(inputs, outputs, sizes):\n"
            '    """ABI entry: inputs (logits f32 [N,E], bias [E]), outputs (weights f32 [N,k], ids i64 [N,k])."""\n'
            f"    launch_moe_route(inputs[{ip[0]}], inputs[{ip[1]}], outputs[{op[0]}], outputs[{op[1]}], "
            "top_k=TOP_K,\n                     scaling=SCALING, renormalize=RENORMALIZE)\n")
    return _module(group, "sigmoid router, biased top-k, renormalised weights", consts, [moe_route_kernel],
                   launch_moe_route, body)


def mx_wgmma_planned(D: int, I: int, scale_max: int, bf16: bool) -> bool:
    """Whether MXFP4 experts plan for the `wgmma` decode kernels: where the default configuration can take them
    (`mx_default_config`: bf16, D and I multiples of WG_BLOCK_K, the one-multiply decoding, scale_max ≤
    ONE_MUL_MAX_SCALE)."""
    return bf16 and D % WG_BLOCK_K == 0 and I % WG_BLOCK_K == 0 and scale_max <= ONE_MUL_MAX_SCALE


def mx_wgmma_rows(rows: int, E: int, D: int, I: int, scale_max: int, bf16: bool) -> int:
    """The tile rows that MXFP4 experts plan for the `wgmma` decode kernels' zs and h (`wg_tile_rows` of their
    largest tile, WG_BLOCK_MS) for `rows` (token, slot) pairs over E experts where `mx_wgmma_planned`, else 0.
    `moe_experts_scratch` declares the same in the graph's dims (`mx_wgmma_dim`)."""
    return wg_tile_rows(rows, E, max(WG_BLOCK_MS)) if mx_wgmma_planned(D, I, scale_max, bf16) else 0


def mx_wgmma_dim(rows, E: int, D: int, I: int, scale_max: int, bf16: bool):
    """`mx_wgmma_rows` for rows a dim of the IR (int or sympy, symbolic in B, T, L): the runtime evaluates it at a
    call's sizes to what the launch asks for."""
    if not mx_wgmma_planned(D, I, scale_max, bf16):
        return 0
    bm = max(WG_BLOCK_MS)
    return bm * sympy.Min(rows, sympy.ceiling(sympy.sympify(rows) / bm) + E)


@scratch("moe_experts")
def moe_experts_scratch(group: KernelGroup) -> list[ScratchSpec]:
    """The scratch of one `moe_experts` launch (`launch_moe_experts`): h [N·k, I] in z's dtype and y_slot f32
    [N·k, D] for N tokens z [N, D] choosing k experts of inner width I (w1 [E, I, ·]); MXFP4 weights also z_perm
    [N, D] in z's dtype and, where the `wgmma` decode kernels can run (`mx_wgmma_rows`: R rows), zs [R, D] in z's
    dtype, h of max(N·k, R) rows and wg_flags i32 [R + 1] (the one-launch form's counters, k3c.codegen.triton.
    moe_mxfp4_fused: 1 + tiles ≤ R + 1). Raises UnsupportedError for a group that is not a single moe_experts node."""
    node, _, _ = one_node(group, "moe_experts")
    z, ids, w1 = node.inputs[0].type, node.inputs[2].type, node.inputs[3].type
    (N, D), rows, (E, I) = z.shape, z.shape[0] * ids.shape[1], w1.shape[:2]
    mx = node.attrs["weight_format"] == "mxfp4"
    wg_rows = mx_wgmma_dim(rows, E, D, I, int(node.attrs["scale_max"]), z.dtype == "bf16") if mx else 0
    out = [ScratchSpec("h", TensorType((sympy.Max(rows, wg_rows) if wg_rows else rows, I), z.dtype)),
           ScratchSpec("y_slot", TensorType((rows, D), "f32"))]
    if mx:
        out.append(ScratchSpec("z_perm", TensorType((N, D), z.dtype)))
    if wg_rows:
        out.append(ScratchSpec("zs", TensorType((wg_rows, D), z.dtype)))
        out.append(ScratchSpec("wg_flags", TensorType((wg_rows + 1,), "i32")))
    return out


#: the kernels' code (`launch_moe_experts`' tiled, the kernels' TILED) of each MXFP4 word layout of the runtime
MX_WORD_LAYOUTS = {"mxfp4_tiles": 1, "mxfp4_tiles_bits": 2}
#: the layout the Triton backend asks of MXFP4 expert words that tile (`moe_experts_layouts`)
MX_WORD_LAYOUT = "mxfp4_tiles_bits"


@weight_layout("moe_experts")
def moe_experts_layouts(group: KernelGroup) -> dict[str, str]:
    """The load-time layouts of one `moe_experts` launch's weights: MXFP4 words w1, w3, w2 in the runtime's
    MX_WORD_LAYOUT (k3c.runtime.layouts' `mxfp4_tiles_bits`: each K tile of a decode CTA one contiguous 4 KB run,
    each word's bits where the 9-instruction decoding takes them) where D and I are multiples of MX_TILE_K, so
    every matrix's rows and K are whole tiles; none for dense experts or other shapes.
    Raises UnsupportedError for a group that is not a single moe_experts node."""
    node, _, _ = one_node(group, "moe_experts")
    if node.attrs["weight_format"] != "mxfp4":
        return {}
    (_, D), I = node.inputs[0].type.shape, node.inputs[3].type.shape[1]
    if not (isinstance(D, int) and mx_tiles_ok(I, D) and mx_tiles_ok(D, I)):
        return {}
    return {v.name: MX_WORD_LAYOUT for v in node.inputs[3:6]}


@emitter("moe_experts")
def emit_moe_experts(group: KernelGroup) -> str:
    """Module text for one `moe_experts` node: inputs (z, weights, ids, w1, w3, w2[, w1/w3/w2 scales]), outputs
    [y].
    Raises UnsupportedError for a group that is not a single moe_experts node."""
    node, ip, op = one_node(group, "moe_experts")
    a = node.attrs
    consts = [("ACT", a["act"], "'situ': SiTU-GLU, 'silu': SwiGLU"),
              ("SITU_BETA", float(a["situ_beta"]), "activation_situ_beta"),
              ("SITU_LINEAR_BETA", float(a["situ_linear_beta"]), "activation_situ_linear_beta"),
              ("SCHEDULE_KERNEL_MAX_ROWS", SCHEDULE_KERNEL_MAX_ROWS, "one-launch tile schedule up to these rows"),
              ("SCALE_MAX", int(a["scale_max"]), "largest MXFP4 scale byte of the checkpoint (255: unknown)"),
              ("ONE_MUL_MAX_SCALE", ONE_MUL_MAX_SCALE, "one-multiply MXFP4 decoding up to this scale byte"),
              ("MX_DECODE_BY_DEVICE", MX_DECODE_BY_DEVICE, "decode configurations tuned per card"),
              ("GLUON_BLOCK_MS", GLUON_BLOCK_MS, "token rows of the Gluon decode tiles"),
              ("WG_ROWS", WG_ROWS, "weight rows of a wgmma decode CTA"),
              ("WG_BLOCK_K", WG_BLOCK_K, "K tile of the wgmma decode kernels"),
              ("WG_ACT_MODES", WG_ACT_MODES, "an mx_config's activation modes that select the wgmma kernels"),
              ("WG_FUSED_MODES", WG_FUSED_MODES, "the modes that select them in one launch"),
              ("WG_BLOCK_MS", WG_BLOCK_MS, "token rows of the wgmma decode tiles"),
              ("MX_TILE_ROWS", MX_TILE_ROWS, "weight rows of a tile of the tiled MXFP4 word layout"),
              ("MX_TILE_K", MX_TILE_K, "values of a row of a tile of the tiled MXFP4 word layout"),
              ("TILED_WORDS", MX_WORD_LAYOUTS[MX_WORD_LAYOUT] if moe_experts_layouts(group) else 0,
               "MXFP4 words' load-time layout: 0 row-major, 1 mxfp4_tiles, 2 mxfp4_tiles_bits")]
    args = ", ".join(f"inputs[{i}]" for i in ip)
    mx = a["weight_format"] == "mxfp4"
    body = ("def launch(inputs, outputs, sizes, scratch=None):\n"
            f'    """ABI entry: inputs (z, weights, ids, w1, w3, w2{", w1_scale, w3_scale, w2_scale" if mx else ""}), '
            'outputs [y [N,D]], scratch: the planned buffers of moe_experts_scratch (None: allocate)."""\n'
            f"    launch_moe_experts({args}, y=outputs[{op[0]}], act=ACT, situ_beta=SITU_BETA,\n"
            "                       situ_linear_beta=SITU_LINEAR_BETA, scratch=scratch, scale_max=SCALE_MAX,\n"
            "                       tiled=TILED_WORDS)\n")
    what = f"{'SiTU-GLU' if a['act'] == 'situ' else 'SwiGLU'}{', MXFP4 weights' if mx else ''}"
    return _module(group, f"grouped expert GEMMs ({what})", consts,
                   [take_scratch, tanh_f32, glu, expert_tile, moe_up_kernel, moe_down_kernel, moe_sum_kernel,
                    mx_default_config, mx_even_unroll, mx_kernels, mx_mma_v2, mx_block_k, mx_permute, mx_permuted_col,
                    mx_tiles_ok, mx_word_offset, mx_word_code, mxfp4_word_bf16, mxfp4_scale_bf16, mxfp4_scales,
                    mxfp4_tile_bf16, mxfp4_tile_f32, mxfp4_weight_tile, mx_act_tile, moe_up_mx_kernel,
                    moe_down_mx_kernel, _max_i32, moe_schedule_kernel, moe_schedule, gluon_decode_ok, gl_act_ahead,
                    gl_layouts, gl_permute, gl_permuted_col, gl_axis_layout, gl_word_offsets, gl_act_offsets,
                    gl_act_operand, gl_decoded_tile, gl_word_values_operand, gl_tile_rows, gl_words2d_layout,
                    gl_word_descs, gl_stage_words, gl_tma_load_named, gl_tma_load, gl_ring_fill, gl_ring_refill,
                    gl_ring_init, moe_up_mx_gluon_kernel, moe_down_mx_gluon_kernel, gl_reinterpret_named,
                    gl_reinterpret, wgmma_decode_ok, wg_permuted_col, wg_gather_kernel, wg_act_desc, wg_word_desc,
                    wg_pair_desc, wg_stage_layouts, wg_ring_fill, wg_decoded_tile, wg_scale_offsets, wg_stage_piece,
                    wg_layouts, wg_mma_piece, wg_scale_pair, wg_opaque, wg_up_step, wg_down_step, wg_cta_rows,
                    wg_narrow, wg_up_tile, wg_down_tile, moe_up_mx_wgmma_kernel, moe_down_mx_wgmma_kernel, wg_up_item,
                    wg_down_item, gl_barrier_named, gl_thread_barrier, wg_proxy_fence, wg_wait_count,
                    moe_mx_wgmma_fused_kernel, schedule_tiles, wg_tile_rows, mx_wgmma_planned, mx_wgmma_rows,
                    mx_wgmma_launches],
                   launch_moe_experts, body)
