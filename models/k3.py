"""Reference PyTorch implementation of the Kimi K3 family (Kimi K3, K3.1 Pro, Kimi Linear).

This module is the ground truth the compiler is checked against. It follows `../shared/K3-SPEC.md` exactly and
is written for reading: one class per concept, formulas named by their spec section.

Public API:
    from models.k3 import K3Config, K3ForCausalLM, load_checkpoint, save_random_checkpoint
    model = K3ForCausalLM(K3Config.from_pretrained("k3-tiny"))
    logits, cache = model(tokens)            # prefill: tokens int64 [B,T] -> logits [B,T,vocab]
    logits, cache = model(next_tok, cache)   # decode (T == 1) or a further prefill chunk

The cache is a flat dict of tensors (a pytree `torch.export` accepts): `pos` (int64 scalar, tokens seen) and per
layer i `layers.i.kda_state` fp32 [B,H,K,V], `layers.i.conv_state` fp32 [B,3HK,W], `layers.i.kv` [B,L,576] (MLA
latents), `layers.i.index_k` [B,L,index_head_dim] (DSA index keys).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from models.checkpoint import load_checkpoint, save_random_checkpoint  # noqa: F401  (public API)
from models.config import PRESETS, TINY_PRESETS, K3Config  # noqa: F401  (public API)
from models.layers import FP32_PARAM_SUFFIXES, KDA, MLA, MLP, MoE, RMSNorm, attn_res, linear


class K3DecoderLayer(nn.Module):
    """One decoder layer: token mixer (KDA / MLA / DSA) then MLP (dense or MoE), joined by Block AttnRes (K3)
    or a plain residual (Kimi Linear) (K3-SPEC.md "Decoder layer")."""

    def __init__(self, cfg: K3Config, i: int):
        super().__init__()
        self.i, self.cfg = i, cfg
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_kind(i)
        self.self_attn = KDA(cfg) if self.kind == "kda" else MLA(cfg, sparse=self.kind == "dsa")
        if cfg.is_moe(i):
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg, D, cfg.intermediate_size)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(D, eps), RMSNorm(D, eps)
        if cfg.attn_res_block_size is not None:
            self.self_attention_res_proj, self.self_attention_res_norm = linear(D, 1), RMSNorm(D, eps)
            self.mlp_res_proj, self.mlp_res_norm = linear(D, 1), RMSNorm(D, eps)

    def _mixer(self, h: Tensor, cache: dict, new_cache: dict) -> Tensor:
        return self.self_attn(self.input_layernorm(h), cache, new_cache, f"layers.{self.i}.")

    def _mlp(self, h: Tensor) -> Tensor:
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return ffn(self.post_attention_layernorm(h))

    def forward(self, blocks: Tensor | None, partial: Tensor, cache: dict, new_cache: dict):
        """(blocks [N,B,T,D] sealed AttnRes blocks, partial [B,T,D]) -> (blocks, partial).

        Kimi Linear has no AttnRes: `blocks` is None and `partial` is the residual stream.
        """
        eps = self.cfg.rms_norm_eps
        if blocks is None:
            h = partial + self._mixer(partial, cache, new_cache)
            return None, h + self._mlp(h)
        sources = torch.cat([blocks, partial.unsqueeze(0)], 0)
        h = attn_res(sources, self.self_attention_res_proj.weight, self.self_attention_res_norm.weight, eps)
        out = self._mixer(h, cache, new_cache)
        if self.cfg.seals_block(self.i):  # seal right after the attention-side read: blocks.append(partial); partial = 0
            blocks, partial = sources, out
        else:
            partial = partial + out
        h = attn_res(torch.cat([blocks, partial.unsqueeze(0)], 0), self.mlp_res_proj.weight, self.mlp_res_norm.weight, eps)
        return blocks, partial + self._mlp(h)


class K3Model(nn.Module):
    """Embedding, decoder layers and final norm; returns the final hidden state [B,T,D]."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_proj = linear(cfg.hidden_size, 1)
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, tokens: Tensor, cache: dict, new_cache: dict) -> Tensor:
        h = self.embed_tokens(tokens)
        blocks = None if self.cfg.attn_res_block_size is None else h.new_zeros((0, *h.shape))
        for layer in self.layers:
            blocks, h = layer(blocks, h, cache, new_cache)
        if blocks is not None:
            h = attn_res(torch.cat([blocks, h.unsqueeze(0)], 0), self.output_attn_res_proj.weight,
                         self.output_attn_res_norm.weight, self.cfg.rms_norm_eps)
        return self.norm(h)


class K3ForCausalLM(nn.Module):
    """The language model: `forward(tokens int64 [B,T], cache=None) -> (logits [B,T,vocab], new cache)`.

    T > 1 is a prefill (or a further prefill chunk), T == 1 a decode step; both are the same computation. Prefill
    in chunks of any size equals one prefill; prefill then decode equals one forward over the whole sequence.
    """

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, batch: int, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """An empty cache (no tokens seen) for `batch` sequences; states zero, KV and index keys of length 0."""
        cfg = self.config
        dev = device if device is not None else self.lm_head.weight.device
        cache = {"pos": torch.zeros((), dtype=torch.int64, device=dev)}
        H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        for i in range(cfg.num_hidden_layers):
            p, kind = f"layers.{i}.", cfg.layer_kind(i)
            if kind == "kda":
                cache[p + "kda_state"] = torch.zeros(batch, H, K, K, dtype=torch.float32, device=dev)
                cache[p + "conv_state"] = torch.zeros(batch, 3 * H * K, W, dtype=torch.float32, device=dev)
            else:
                cache[p + "kv"] = torch.zeros(batch, 0, cfg.mla_cache_width, dtype=self.dtype, device=dev)
            if kind == "dsa":
                cache[p + "index_k"] = torch.zeros(batch, 0, cfg.index_head_dim, dtype=self.dtype, device=dev)
        return cache

    def forward(self, tokens: Tensor, cache: dict[str, Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        if cache is None:
            cache = self.new_cache(tokens.shape[0], tokens.device)
        new_cache: dict[str, Tensor] = {"pos": cache["pos"] + tokens.shape[1]}
        hidden = self.model(tokens, cache, new_cache)
        return self.lm_head(hidden), new_cache

    # ---- weights ------------------------------------------------------------------------------------------------
    def cast_(self, dtype: torch.dtype) -> "K3ForCausalLM":
        """Cast parameters to `dtype`, keeping the fp32 ones of the published checkpoint (A_log, dt_bias, convs,
        o_norm) in fp32. Returns self."""
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype)
        return self

    @torch.no_grad()
    def init_random_(self, seed: int, device: str | torch.device = "cpu") -> "K3ForCausalLM":
        """Deterministic random weights with realistic scales (activations stay O(1) through every layer).

        Each parameter draws from its own generator on `device` seeded by (seed, parameter name), so the values do
        not depend on construction order (they do depend on `device`: CPU and CUDA generators differ; drawing on a
        GPU is what makes a full-width random model quick to build). Linear weights ~ N(0, 1/in); output
        projections are further scaled by 1/sqrt(2 * layers); norms ~ 1 + N(0, 0.1^2); A_log = log U(1, 16) (Kimi
        Linear's init); router bias ~ N(0, 0.1^2).
        """
        depth_scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in sorted(self.named_parameters()):
            gen = torch.Generator(device).manual_seed((seed * 1_000_003 + _stable_hash(name)) % 2**63)
            shape = p.shape
            if name.endswith("A_log"):
                val = torch.empty(shape, device=device).uniform_(1, 16, generator=gen).log()
            elif name.endswith(("norm.weight", "layernorm.weight")) or ".o_norm." in name:
                val = 1 + 0.1 * torch.randn(shape, generator=gen, device=device)
            elif name.endswith(("e_score_correction_bias", "dt_bias", "k_norm.bias")):
                val = 0.1 * torch.randn(shape, generator=gen, device=device)
            elif name.endswith("embed_tokens.weight"):
                val = torch.randn(shape, generator=gen, device=device)
            elif "conv1d" in name:
                val = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
            else:  # projections: [out, in] or stacked experts [E, out, in]
                val = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2", "routed_expert_up_proj.weight")):
                    val = val * depth_scale
            p.copy_(val.to(p.dtype))
        return self


def _stable_hash(text: str) -> int:
    """A hash of `text` that is the same in every process (Python's hash() is salted)."""
    h = 1469598103934665603
    for ch in text.encode():
        h = ((h ^ ch) * 1099511628211) % 2**64
    return h
