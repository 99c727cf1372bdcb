"""torch.export of the reference model, one piece per distinct sublayer.

A K3-family decoder layer is Block AttnRes reads, a token mixer and an MLP joined by residual adds
(`K3DecoderLayer.forward`), and the mixers and MLPs of a model come in a few kinds. k3c exports each distinct
piece once and instantiates it per use (`k3c.frontend.import_model` composes the pieces in the order of
`K3DecoderLayer.forward`): a 93-layer model is 7 small exports, not one 20k-node trace nor one export per
layer signature (which traced the shared KDA mixer, AttnRes and MoE again for every combination). The pieces:
- `embed`: tokens [B,T] -> h [B,T,D];
- `attn_res`: (blocks [N,B,T,D], partial [B,T,D]) -> (h [B,T,D], sources [N+1,B,T,D]): the AttnRes read over the
  sealed blocks and the partial sum (`sources` is what a sealing layer keeps as its blocks); its two parameters
  (`proj`, `norm`) bind per use;
- `mixer/<kind>` (kda, mla, dsa): (h, cache entries) -> (out, new cache entries): `K3DecoderLayer._mixer`;
- `ffn/<dense|moe>`: h -> out: `K3DecoderLayer._mlp`;
- `head`: (h[, blocks]) -> logits [B,T,vocab].
Dims are symbolic: B (batch), T (new tokens), L (cached tokens before this call), N (sealed AttnRes blocks); the
decode entry point is the prefill graph specialised to T = 1 (`k3c.frontend.import_model`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._dynamo import config as dynamo_config
from torch.export import Dim, ExportedProgram, export

from k3c.errors import UnsupportedError
from models.k3 import K3DecoderLayer, K3ForCausalLM
from models.layers import attn_res

# Sample sizes for tracing: distinct and >= 2 so that no dim is specialised (torch.export specialises 0 and 1).
SAMPLE = {"B": 2, "T": 3, "L": 5, "N": 2}


@dataclass
class Segment:
    """One exported piece: `program`, the role of each user input in order (`inputs`) and of each output."""

    name: str
    program: ExportedProgram
    inputs: list[str]
    outputs: list[str]


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


class _AttnRes(nn.Module):
    """The AttnRes read of `K3DecoderLayer.forward`: sources = [blocks; partial], h = attn_res(sources)."""

    def __init__(self, layer: K3DecoderLayer):
        super().__init__()
        self.proj, self.norm = layer.self_attention_res_proj, layer.self_attention_res_norm
        self.eps = layer.cfg.rms_norm_eps

    def forward(self, blocks: Tensor, partial: Tensor) -> tuple[Tensor, Tensor]:
        sources = torch.cat([blocks, partial.unsqueeze(0)], 0)
        return attn_res(sources, self.proj.weight, self.norm.weight, self.eps), sources


class _Mixer(nn.Module):
    """`K3DecoderLayer._mixer` (input RMSNorm, token mixer). It holds the whole layer, so parameter names and module
    paths are the layer's own (`layer.self_attn.q_proj.weight`); the importer skips the lifted ones it never reads."""

    def __init__(self, layer: K3DecoderLayer, cache_keys: list[str]):
        super().__init__()
        self.layer, self.cache_keys = layer, cache_keys

    def forward(self, h: Tensor, cache: dict[str, Tensor]):
        prefix = f"layers.{self.layer.i}."
        new: dict[str, Tensor] = {}
        out = self.layer._mixer(h, {prefix + k: v for k, v in cache.items()}, new)
        return out, {k: new[prefix + k] for k in self.cache_keys}


class _Ffn(nn.Module):
    """`K3DecoderLayer._mlp` (post-attention RMSNorm, MLP or MoE); holds the whole layer like `_Mixer`."""

    def __init__(self, layer: K3DecoderLayer):
        super().__init__()
        self.layer = layer

    def forward(self, h: Tensor) -> Tensor:
        return self.layer._mlp(h)


def mixer_segment(model: K3ForCausalLM, i: int) -> str:
    """The name of layer i's mixer piece."""
    return "mixer/" + model.config.layer_kind(i)


def ffn_segment(model: K3ForCausalLM, i: int) -> str:
    """The name of layer i's MLP piece."""
    return "ffn/" + ("moe" if model.config.is_moe(i) else "dense")


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


_CACHE: dict[tuple, dict[str, Segment]] = {}


def export_segments(model: K3ForCausalLM) -> dict[str, Segment]:
    """Export every distinct piece of `model` (see the module docstring); returns them by name.

    The exported structure depends only on the config and the parameters' dtypes (parameters are bound by name at
    import; a checkpoint may keep some in f32 beside bf16 ones), so results are memoised per process under that
    key. Raises UnsupportedError when torch.export fails, naming the
    segment and the model line it stopped at.
    """
    key = (json.dumps(model.config.raw, sort_keys=True), model.config.name,
           tuple((n, str(p.dtype)) for n, p in model.named_parameters()))
    if key not in _CACHE:
        _CACHE[key] = _export_all(model)
    return _CACHE[key]


def _export_all(model: K3ForCausalLM) -> dict[str, Segment]:
    cfg = model.config
    dev = model.lm_head.weight.device
    dt = model.dtype
    dB, dT = Dim("B", min=1, max=1 << 16), Dim("T", min=2, max=1 << 24)
    dL, dN = Dim("L", min=0, max=1 << 24), Dim("N", min=0, max=1 << 10)
    act_dims, blk_dims = {0: dB, 1: dT}, {0: dN, 1: dB, 2: dT}
    h = torch.zeros(SAMPLE["B"], SAMPLE["T"], cfg.hidden_size, dtype=dt, device=dev)
    blocks = torch.zeros(SAMPLE["N"], SAMPLE["B"], SAMPLE["T"], cfg.hidden_size, dtype=dt, device=dev)
    attn_res_on = cfg.attn_res_block_size is not None
    tokens = torch.zeros(SAMPLE["B"], SAMPLE["T"], dtype=torch.long, device=dev)
    segs = {"embed": _export("embed", _Embed(model), (tokens,), (act_dims,), ["tokens"], ["h"])}
    layers = model.model.layers
    if attn_res_on:
        segs["attn_res"] = _export("attn_res", _AttnRes(layers[0]), (blocks, h), (blk_dims, act_dims),
                                   ["blocks", "partial"], ["h", "sources"])
    for i in range(cfg.num_hidden_layers):
        name = mixer_segment(model, i)
        if name not in segs:
            keys = layer_cache_keys(model, i)
            cache_dims = {k: ({0: dB, 1: dL} if k in ("kv", "index_k") else {0: dB}) for k in keys}
            segs[name] = _export(name, _Mixer(layers[i], keys), (h, _sample_cache(model, i, dev)),
                                 (act_dims, cache_dims), ["h"] + [f"cache.{k}" for k in keys],
                                 ["out"] + [f"new.{k}" for k in keys])
        name = ffn_segment(model, i)
        if name not in segs:
            segs[name] = _export(name, _Ffn(layers[i]), (h,), (act_dims,), ["h"], ["out"])
    head_args = (h, blocks) if attn_res_on else (h,)
    head_dims = (act_dims, blk_dims) if attn_res_on else (act_dims,)
    segs["head"] = _export("head", _Head(model), head_args, head_dims, ["h"] + (["blocks"] if attn_res_on else []),
                           ["logits"])
    return segs


def _export(name: str, module: nn.Module, args: tuple, dims: tuple, inputs: list[str], outputs: list[str]) -> Segment:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # FakeTensor's dispatch cache rarely hits here (each export has its own symbols) and every miss builds
            # and checks an entry: off, a piece exports ~1.5x faster
            with dynamo_config.patch(fake_tensor_cache_enabled=False):
                ep = export(module, args, dynamic_shapes=dims, strict=False)
    except Exception as e:  # torch.export raises many types; report one line naming the segment
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedError(f"torch.export of segment '{name}' failed: {first}") from e
    return Segment(name, ep, inputs, outputs)
