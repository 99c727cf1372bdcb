"""torch.export of the reference model, one segment at a time.

Layers of one kind share their structure, so k3c exports each distinct *layer signature* once and instantiates it
per layer (a 93-layer model is 4 or 5 exports, not one 20k-node trace). A signature is (mixer kind, dense or MoE,
seals an AttnRes block, has AttnRes). The segments:
- `embed`: tokens [B,T] -> h [B,T,D];
- `layer/<signature>`: (blocks [N,B,T,D], partial [B,T,D], cache entries) -> (blocks, partial, new cache entries),
  with the number of sealed blocks N a symbol bound per layer at instantiation;
- `head`: (blocks, h) -> logits [B,T,vocab].
Dims are symbolic: B (batch), T (new tokens; the literal 1 for the decode entry), L (cached tokens before this
call), N (sealed AttnRes blocks).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram, export

from k3c.errors import UnsupportedError
from models.k3 import K3DecoderLayer, K3ForCausalLM
from models.layers import attn_res

# Sample sizes for tracing: distinct and >= 2 so that no dim is specialised (torch.export specialises 0 and 1).
SAMPLE = {"B": 2, "T": 3, "L": 5, "N": 2}
CACHE_SUFFIXES = ("kda_state", "conv_state", "kv", "index_k")


@dataclass
class Segment:
    """One exported piece: `program`, the placeholder roles (`inputs`: role per user input, in order), the output
    roles, and the symbol of each role's dims (`dims`: placeholder role -> tuple of symbol names or ints)."""

    name: str
    program: ExportedProgram
    inputs: list[str]
    outputs: list[str]
    param_prefix: str  # prefix that turns the segment's parameter names into checkpoint keys (before renaming)


class _Embed(nn.Module):
    def __init__(self, model: K3ForCausalLM):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embed_tokens(tokens)


class _Head(nn.Module):
    def __init__(self, model: K3ForCausalLM):
        super().__init__()
        self.cfg = model.config
        self.norm, self.lm_head = model.model.norm, model.lm_head
        if self.cfg.attn_res_block_size is not None:
            self.output_attn_res_proj = model.model.output_attn_res_proj
            self.output_attn_res_norm = model.model.output_attn_res_norm

    def forward(self, h: Tensor, blocks: Tensor | None = None) -> Tensor:
        if blocks is not None:
            h = attn_res(torch.cat([blocks, h.unsqueeze(0)], 0), self.output_attn_res_proj.weight,
                         self.output_attn_res_norm.weight, self.cfg.rms_norm_eps)
        return self.lm_head(self.norm(h))


class _Layer(nn.Module):
    def __init__(self, layer: K3DecoderLayer, cache_keys: list[str]):
        super().__init__()
        self.layer, self.cache_keys = layer, cache_keys

    def forward(self, partial: Tensor, cache: dict[str, Tensor], blocks: Tensor | None = None):
        prefix = f"layers.{self.layer.i}."
        full = {prefix + k: v for k, v in cache.items()}
        new: dict[str, Tensor] = {}
        blocks, partial = self.layer(blocks, partial, full, new)
        outs = {k: new[prefix + k] for k in self.cache_keys}
        return (partial, outs) if blocks is None else (partial, outs, blocks)


def layer_signature(model: K3ForCausalLM, i: int) -> str:
    cfg = model.config
    parts = [cfg.layer_kind(i), "moe" if cfg.is_moe(i) else "dense"]
    if cfg.attn_res_block_size is not None:
        parts.append("seal" if cfg.seals_block(i) else "attnres")
    return "-".join(parts)


def layer_cache_keys(model: K3ForCausalLM, i: int) -> list[str]:
    kind = model.config.layer_kind(i)
    return {"kda": ["kda_state", "conv_state"], "mla": ["kv"], "dsa": ["kv", "index_k"]}[kind]


def _sample_cache(model: K3ForCausalLM, i: int, device) -> dict[str, Tensor]:
    full = model.new_cache(SAMPLE["B"], device)
    out = {}
    for k in layer_cache_keys(model, i):
        t = full[f"layers.{i}.{k}"]
        if k in ("kv", "index_k"):
            t = torch.zeros(SAMPLE["B"], SAMPLE["L"], t.shape[-1], dtype=t.dtype, device=device)
        out[k] = t
    return out


_CACHE: dict[tuple, tuple] = {}


def export_segments(model: K3ForCausalLM, entry: str) -> tuple[dict[str, Segment], dict[int, str]]:
    """Export the embed, head and one segment per layer signature for `entry` in {"prefill", "decode"}.

    Returns (segments by name, layer index -> its segment name). The exported structure depends only on the
    config and dtype (parameters are bound by name at import), so results are memoised per process under that
    key. Raises UnsupportedError when torch.export fails, naming the segment and the model line it stopped at.
    """
    if entry not in ("prefill", "decode"):
        raise UnsupportedError(f"entry point must be 'prefill' or 'decode', found {entry!r}")
    key = (json.dumps(model.config.raw, sort_keys=True), model.config.name, str(model.dtype), entry)
    if key not in _CACHE:
        _CACHE[key] = _export_all(model, entry)
    return _CACHE[key]


def _export_all(model: K3ForCausalLM, entry: str) -> tuple[dict[str, Segment], dict[int, str]]:
    cfg = model.config
    dev = model.lm_head.weight.device
    dt = model.dtype
    T = SAMPLE["T"] if entry == "prefill" else 1
    dB, dT = Dim("B", min=1, max=1 << 16), (Dim("T", min=2, max=1 << 24) if entry == "prefill" else None)
    dL, dN = Dim("L", min=0, max=1 << 24), Dim("N", min=0, max=1 << 10)
    tok_dims = {0: dB, 1: dT} if dT is not None else {0: dB}
    act_dims = {0: dB, 1: dT} if dT is not None else {0: dB}
    blk_dims = {0: dN, 1: dB, 2: dT} if dT is not None else {0: dN, 1: dB}
    h = torch.zeros(SAMPLE["B"], T, cfg.hidden_size, dtype=dt, device=dev)
    blocks = torch.zeros(SAMPLE["N"], SAMPLE["B"], T, cfg.hidden_size, dtype=dt, device=dev)
    attn_res_on = cfg.attn_res_block_size is not None
    segs: dict[str, Segment] = {}
    tokens = torch.zeros(SAMPLE["B"], T, dtype=torch.long, device=dev)
    segs["embed"] = _export("embed", _Embed(model), (tokens,), ({**tok_dims},), ["tokens"], ["h"], "model.")
    head_args = (h, blocks) if attn_res_on else (h,)
    head_dims = (act_dims, blk_dims) if attn_res_on else (act_dims,)
    segs["head"] = _export("head", _Head(model), head_args, head_dims, ["h"] + (["blocks"] if attn_res_on else []),
                           ["logits"], "")
    which: dict[int, str] = {}
    for i in range(cfg.num_hidden_layers):
        name = "layer/" + layer_signature(model, i)
        which[i] = name
        if name in segs:
            continue
        keys = layer_cache_keys(model, i)
        cache = _sample_cache(model, i, dev)
        cache_dims = {k: ({0: dB, 1: dL} if k in ("kv", "index_k") else {0: dB}) for k in keys}
        args = (h, cache, blocks) if attn_res_on else (h, cache)
        dims = (act_dims, cache_dims, blk_dims) if attn_res_on else (act_dims, cache_dims)
        ins = ["partial"] + [f"cache.{k}" for k in keys] + (["blocks"] if attn_res_on else [])
        outs = ["partial"] + [f"new.{k}" for k in keys] + (["blocks"] if attn_res_on else [])
        segs[name] = _export(name, _Layer(model.model.layers[i], keys), args, dims, ins, outs, "layer.")
        segs[name].layer_index = i
    return segs, which


def _export(name: str, module: nn.Module, args: tuple, dims: tuple, inputs: list[str], outputs: list[str],
            prefix: str) -> Segment:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = export(module, args, dynamic_shapes=dims, strict=False)
    except Exception as e:  # torch.export raises many types; report one line naming the segment
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedError(f"torch.export of segment '{name}' failed: {first}") from e
    return Segment(name, ep, inputs, outputs, prefix)
