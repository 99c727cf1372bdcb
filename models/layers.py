"""Building blocks of the K3 family: norms, Block AttnRes, KDA, gated MLA / DSA, SiTU-GLU MLP and (Latent)MoE.

Every formula follows `../shared/K3-SPEC.md`; the section is named in each docstring. Shapes: B batch, T new
tokens, L cached + new tokens, D hidden, H heads. Parameters are named as in the published checkpoint, so a
module's `state_dict()` keys are the checkpoint keys (routed experts excepted: they are stacked, see `MoE`).
Caches are dicts of tensors, read from `cache` and written to `new_cache` (functional: nothing is mutated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import ops  # noqa: F401  (registers torch.ops.k3.*)
from models.config import K3Config

# Parameters kept in fp32 whatever the model dtype (published checkpoint: K3-SPEC.md "KDA layer").
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight")


def linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight, computed in fp32 (K3-SPEC.md; eps from rms_norm_eps)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2, -1) + eps), in fp32 (K3-SPEC.md "KDA layer")."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def attn_res(sources: Tensor, proj_weight: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """Block Attention Residuals (arXiv 2603.15031; K3-SPEC.md "Decoder layer").

    sources V: [S,B,T,D] (sealed blocks, then the partial sum); keys K = V * rsqrt(mean(V^2) + eps);
    logits = K . (norm_weight * proj_weight[0]) (no 1/sqrt(d)); softmax over the S sources in fp32; returns
    sum_s w_s V_s [B,T,D] in the sources' dtype. With one source the weight is exactly 1 and V_0 is returned.
    """
    V = sources.float()
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    logits = (K * (norm_weight.float() * proj_weight[0].float())).sum(-1)  # [S,B,T]
    w = torch.softmax(logits, dim=0)
    return (w.unsqueeze(-1) * V).sum(0).to(sources.dtype)


class KDA(nn.Module):
    """Kimi Delta Attention (K3-SPEC.md "KDA layer"; Kimi Linear report §3).

    x [B,T,D] -> [B,T,D]. Cache entries for layer i: `layers.i.kda_state` fp32 [B,H,K,V] and `layers.i.conv_state`
    fp32 [B, 3*H*K, W] (the last W raw projected inputs of q, k and v, in that channel order).
    """

    def __init__(self, cfg: K3Config):
        super().__init__()
        H, K, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size, cfg.conv_kernel_size
        self.H, self.K, self.W, self.eps = H, K, W, cfg.rms_norm_eps
        self.lower_bound = cfg.gate_lower_bound
        self.q_proj, self.k_proj, self.v_proj = linear(D, H * K), linear(D, H * K), linear(D, H * K)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
                                                       for _ in range(3))
        self.f_a_proj, self.f_b_proj = linear(D, K), linear(K, H * K)
        self.b_proj = linear(D, H)
        if cfg.use_full_rank_gate:
            self.g_proj = linear(D, H * K)
        else:  # Kimi Linear: low-rank output gate
            self.g_a_proj, self.g_b_proj = linear(D, K), linear(K, H * K)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = linear(H * K, D)

    def forward(self, x: Tensor, cache: dict, new_cache: dict, prefix: str) -> Tensor:
        B, T, _ = x.shape
        H, K, W = self.H, self.K, self.W
        # causal depthwise short conv over [conv_state | new inputs] (kernel W), then silu
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).float().transpose(1, 2)  # [B,3HK,T]
        window = torch.cat([cache[prefix + "conv_state"], raw], -1)  # [B,3HK,W+T]
        conv_w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0).float()
        new_cache[prefix + "conv_state"] = window[:, :, -W:]
        y = F.silu(F.conv1d(window, conv_w, groups=3 * H * K)[:, :, 1:]).transpose(1, 2)  # [B,T,3HK]
        q, k, v = (t.reshape(B, T, H, K) for t in y.split(H * K, -1))
        q = l2norm(q) * K ** -0.5
        k = l2norm(k)
        # decay gate (log-decay g <= 0) and beta
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).reshape(B, T, H, K)
        a = self.A_log.float()[:H].exp().reshape(H, 1)
        if self.lower_bound is not None:  # K3: lower-bounded sigmoid, g in (lower_bound, 0)
            g = self.lower_bound * torch.sigmoid(a * f)
        else:  # Kimi Linear: g = -exp(A_log) softplus(f)
            g = -a * F.softplus(f)
        beta = torch.sigmoid(self.b_proj(x).float())
        o, state = torch.ops.k3.kda_recurrence(q, k, v, g, beta, cache[prefix + "kda_state"])
        new_cache[prefix + "kda_state"] = state
        # per-head RMSNorm and sigmoid output gate
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float()
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = o.reshape(B, T, H * K) * torch.sigmoid(gate.float())
        return self.o_proj(o.to(x.dtype))


class Indexer(nn.Module):
    """DSA lightning indexer (K3-SPEC.md "Gated DSA"; DeepSeek-V3.2 §2.1), NoPE.

    Query heads from the q-LoRA latent, one shared key per token (LayerNorm'd), per-head weights from x.
    """

    def __init__(self, cfg: K3Config):
        super().__init__()
        J, Dk = cfg.index_num_heads, cfg.index_head_dim
        self.J, self.Dk, self.topk = J, Dk, cfg.index_topk
        self.wq_b = linear(cfg.q_lora_rank, J * Dk)
        self.wk = linear(cfg.hidden_size, Dk)
        self.k_norm = nn.LayerNorm(Dk, eps=1e-6)
        self.weights_proj = linear(cfg.hidden_size, J)

    def forward(self, x: Tensor, qr: Tensor, cache: dict, new_cache: dict, prefix: str) -> Tensor:
        """Returns int64 [B,T,topk] selected key positions (-1 = none) and writes `layers.i.index_k` [B,L,Dk]."""
        B, T, _ = x.shape
        keys = torch.cat([cache[prefix + "index_k"], self.k_norm(self.wk(x))], 1)
        new_cache[prefix + "index_k"] = keys
        q_idx = self.wq_b(qr).reshape(B, T, self.J, self.Dk)
        w = self.weights_proj(x) * (self.J ** -0.5 * self.Dk ** -0.5)
        return torch.ops.k3.dsa_topk(q_idx, w, keys, self.topk)


class MLA(nn.Module):
    """Gated multi-head latent attention, NoPE (K3-SPEC.md "Gated MLA"); gated DSA when `sparse`.

    x [B,T,D] -> [B,T,D]. Cache entry `layers.i.kv` [B,L, kv_lora_rank + rope]: the kv_a_layernorm'd latent and
    the shared 64-value key part. (The spec caches the latent before its norm; caching it normalised is the same
    math and saves re-normalising the whole cache every step.) This is the naive (unabsorbed) form; the compiler's
    `absorb_mla` pass derives the MQA form.
    """

    def __init__(self, cfg: K3Config, sparse: bool):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.nope, self.rope, self.vd, self.r = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        qd = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = linear(D, H * qd)
        else:
            self.q_a_proj, self.q_a_layernorm = linear(D, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = linear(cfg.q_lora_rank, H * qd)
        self.kv_a_proj_with_mqa = linear(D, self.r + self.rope)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = linear(self.r, H * (self.nope + self.vd))
        if cfg.mla_use_output_gate:
            self.g_proj = linear(D, H * self.vd)
        self.o_proj = linear(H * self.vd, D)
        if sparse:
            self.indexer = Indexer(cfg)

    def forward(self, x: Tensor, cache: dict, new_cache: dict, prefix: str) -> Tensor:
        B, T, _ = x.shape
        H, nope, vd = self.H, self.nope, self.vd
        if hasattr(self, "q_proj"):
            qr, q = None, self.q_proj(x)
        else:
            qr = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(qr)
        q = q.reshape(B, T, H, nope + self.rope)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.rope], -1)
        kv = torch.cat([cache[prefix + "kv"], torch.cat([self.kv_a_layernorm(c), k_pe], -1)], 1)  # [B,L,r+rope]
        new_cache[prefix + "kv"] = kv
        L = kv.shape[1]
        k_nope, v = self.kv_b_proj(kv[..., :self.r]).reshape(B, L, H, nope + vd).split([nope, vd], -1)
        scores = (torch.einsum("bthd,bshd->bhts", q[..., :nope], k_nope)
                  + torch.einsum("bthd,bsd->bhts", q[..., nope:], kv[..., self.r:])).float() * (nope + self.rope) ** -0.5
        visible = torch.arange(L, device=x.device)[None, :] <= torch.arange(L - T, L, device=x.device)[:, None]  # causal
        mask = visible.expand(B, 1, T, L)
        if hasattr(self, "indexer"):  # DSA: only the indexer's top-k keys (all visible ones while L <= top-k)
            idx = self.indexer(x, qr, cache, new_cache, prefix)
            hit = torch.zeros(B, T, L + 1, dtype=torch.bool, device=x.device)
            hit = hit.scatter(-1, idx + 1, torch.ones_like(idx, dtype=torch.bool))[..., 1:]  # -1 lands in column 0
            mask = mask & hit.unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        out = torch.einsum("bhts,bshd->bthd", probs, v.float()).reshape(B, T, H * vd)
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(out.to(x.dtype))


class MLP(nn.Module):
    """Dense gated MLP: down_proj(act(gate_proj(x), up_proj(x))); act is SiTU-GLU (K3) or SwiGLU (Kimi Linear)."""

    def __init__(self, cfg: K3Config, d_in: int, d_hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(d_in, d_hidden), linear(d_in, d_hidden), linear(d_hidden, d_in)
        self.act = (cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.glu_act(self.gate_proj(x), self.up_proj(x), *self.act))


class MoE(nn.Module):
    """Stable LatentMoE (K3) or plain MoE (Kimi Linear) (K3-SPEC.md "MLP and Stable LatentMoE").

    y = shared_experts(x) + up(RMSNorm(sum_i p_i E_i(down(x)))) with the latent (K3), or
    y = shared_experts(x) + sum_i p_i E_i(x) (Kimi Linear). Routed experts are stacked: `experts.w1`, `experts.w3`
    [E, I, latent] and `experts.w2` [E, latent, I] (the checkpoint's `experts.E.w1.weight` rows, stacked on load).
    """

    def __init__(self, cfg: K3Config):
        super().__init__()
        D, Dl, E, I = cfg.hidden_size, cfg.moe_latent_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.scaling, self.renorm = cfg.num_experts_per_token, cfg.routed_scaling_factor, cfg.moe_renormalize
        self.act = (cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(E, D))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E))
        if cfg.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj, self.routed_expert_up_proj = linear(D, Dl), linear(Dl, D)
            self.routed_expert_norm = RMSNorm(Dl, cfg.rms_norm_eps)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.zeros(E, I, Dl))
        self.experts.w3 = nn.Parameter(torch.zeros(E, I, Dl))
        self.experts.w2 = nn.Parameter(torch.zeros(E, Dl, I))
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg, D, I * cfg.num_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        logits = F.linear(xf.float(), self.gate.weight.float())
        weights, ids = torch.ops.k3.moe_route(logits, self.gate.e_score_correction_bias, self.top_k, self.scaling, self.renorm)
        latent = hasattr(self, "routed_expert_down_proj")
        z = self.routed_expert_down_proj(xf) if latent else xf
        y = torch.ops.k3.moe_experts(z, weights, ids, self.experts.w1, self.experts.w3, self.experts.w2, *self.act)
        if latent:
            y = self.routed_expert_up_proj(self.routed_expert_norm(y))
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(xf)
        return y.reshape(B, T, D)
