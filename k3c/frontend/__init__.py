"""The frontend: the reference model (`models/k3.py`) -> torch.export -> k3c IR.

    graph = import_model("k3.1-pro", entry="decode")          # full model on the meta device: no weights
    graph = import_model(model, entry="prefill")              # a loaded K3ForCausalLM

The prefill entry (T symbolic) is exported; the decode entry is the same graph specialised to T = 1 (the model
computes one function for any T, so one export serves both). Each distinct layer signature is exported once (`segments.py`) and instantiated for every layer of that
signature (`fx_import.py`), with parameters bound to the layer's own keys and the AttnRes block count N bound to
the layer's number of sealed blocks. The result is one graph with:
- inputs: `tokens` i64 [B,T] (T is 1 for decode), then the cache: per layer `layers.i.kda_state` f32 [B,H,K,K],
  `layers.i.conv_state` f32 [B,3HK,W], `layers.i.kv` [B,L,kv_lora_rank+rope], `layers.i.index_k` [B,L,Dk];
- params: keyed by the reference model's parameter names (the checkpoint key without `language_model.`;
  routed experts stacked as `...experts.w1` [E,I,D]);
- outputs: `logits` [B,T,vocab] and the new cache entries under the same names as the inputs.
The cache's token count `pos` is kept by the runtime (the K3 family is NoPE: no op reads positions).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from k3c.errors import IRError, UnsupportedError
from k3c.frontend.fx_import import FxImporter
from k3c.frontend.segments import SAMPLE, export_segments, layer_cache_keys
from k3c.ir.graph import Graph, Value
from k3c.ir.specialize import specialize
from k3c.ir.types import TensorType, dtype_of, symbol
from models.config import K3Config
from models.k3 import K3ForCausalLM

ENTRIES = ("prefill", "decode")


def build_meta_model(cfg: K3Config | str) -> K3ForCausalLM:
    """The reference model on the meta device (no memory for weights)."""
    cfg = cfg if isinstance(cfg, K3Config) else K3Config.from_pretrained(cfg)
    with torch.device("meta"):
        return K3ForCausalLM(cfg)


def import_model(model: K3ForCausalLM | K3Config | str, entry: str = "prefill",
                 progress: Callable[[int, int], None] | None = None, stats: dict | None = None) -> Graph:
    """Import `model` (a module, a config or a preset/config path) into a k3c graph for `entry`.

    progress(done, total) is called per layer; stats (if given) receives timings in seconds and node counts.
    Raises ConfigError (bad config), UnsupportedError (an op without a lowering, naming the model line).
    """
    if entry not in ENTRIES:
        raise UnsupportedError(f"entry point must be one of {', '.join(ENTRIES)}, found {entry!r}")
    if not isinstance(model, K3ForCausalLM):
        model = build_meta_model(model)
    if entry == "decode":  # decode is prefill at T = 1: one export serves both entry points
        prefill = import_model(model, "prefill", progress, stats)
        return specialize(prefill, {"T": 1}, pass_name="import(decode)")
    cfg = model.config
    t0 = time.perf_counter()
    segs, which = export_segments(model, entry)
    t1 = time.perf_counter()
    g = Graph()
    B, T = "B", ("T" if entry == "prefill" else 1)
    tokens = g.add_input("tokens", TensorType((B, T), "i64"))
    named = dict(model.named_parameters())

    def param(key: str) -> Value:
        if key not in g.params:
            p = named[key]
            g.add_param(key, TensorType(tuple(p.shape), dtype_of(p.dtype)))
        return g.params[key]

    cache_in: dict[str, Value] = {}
    for i in range(cfg.num_hidden_layers):
        for k in layer_cache_keys(model, i):
            name = f"layers.{i}.{k}"
            t = _cache_type(model, i, k)
            cache_in[name] = g.add_input(name, t)
    im = FxImporter(g)
    base = {"B": symbol("B"), "T": symbol("T"), "L": symbol("L"), "N": symbol("N")}

    def subs_for(seg, n_blocks: int | None) -> dict:
        out = {}
        for fx, role in zip(_user_placeholders(seg.program), seg.inputs):
            axes = _role_axes(role, entry)
            for ax, sym in zip(fx.meta["val"].shape, axes):
                if sym is not None and isinstance(ax, torch.SymInt):
                    out[ax.node.expr] = n_blocks if sym == "N" else base[sym]
        return out

    attn_res = cfg.attn_res_block_size is not None
    (h,) = im.run(segs["embed"].program, [tokens], lambda fqn: param("model." + fqn), subs_for(segs["embed"], None),
                  None, "embed")
    blocks = g.add_node("zeros", [], {"shape": [0, B, T, cfg.hidden_size], "dtype": h.type.dtype},
                        name_hint="attn_res.blocks0")[0] if attn_res else None
    n_blocks = 0
    for i in range(cfg.num_hidden_layers):
        seg = segs[which[i]]
        keys = layer_cache_keys(model, i)
        ins = [h] + [cache_in[f"layers.{i}.{k}"] for k in keys] + ([blocks] if attn_res else [])
        outs = im.run(seg.program, ins, lambda fqn, i=i: param(f"model.layers.{i}." + fqn[len("layer."):]),
                      subs_for(seg, n_blocks), i, f"l{i}")
        h = outs[0]
        for k, v in zip(keys, outs[1:1 + len(keys)]):
            g.set_output(f"layers.{i}.{k}", v)
        if attn_res:
            blocks = outs[-1]
            n_blocks += cfg.seals_block(i)
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
    head = segs["head"]
    head_param = lambda fqn: param(fqn if fqn.startswith("lm_head") else "model." + fqn)  # noqa: E731
    (logits,) = im.run(head.program, [h] + ([blocks] if attn_res else []), head_param, subs_for(head, n_blocks),
                       None, "head")
    g.set_output("logits", logits)
    g.outputs = {"logits": g.outputs.pop("logits"), **g.outputs}
    if stats is not None:
        stats.update(export_s=t1 - t0, import_s=time.perf_counter() - t1, nodes=len(g.nodes), segments=len(segs))
    return g


def _user_placeholders(program):
    user = set(program.graph_signature.user_inputs)
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user]


def _role_axes(role: str, entry: str) -> tuple:
    T = "T" if entry == "prefill" else None
    return {"tokens": ("B", T), "h": ("B", T, None), "partial": ("B", T, None), "blocks": ("N", "B", T, None),
            "cache.kv": ("B", "L", None), "cache.index_k": ("B", "L", None),
            "cache.kda_state": ("B", None, None, None), "cache.conv_state": ("B", None, None)}[role]


def _cache_type(model: K3ForCausalLM, i: int, key: str) -> TensorType:
    cfg = model.config
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    dt = dtype_of(model.dtype)
    return {"kda_state": TensorType(("B", H, K, K), "f32"), "conv_state": TensorType(("B", 3 * H * K, W), "f32"),
            "kv": TensorType(("B", "L", cfg.mla_cache_width), dt),
            "index_k": TensorType(("B", "L", cfg.index_head_dim), dt)}[key]


def graph_params(model: K3ForCausalLM, graph: Graph) -> dict[str, torch.Tensor]:
    """The model's tensors for every parameter of `graph` (for the interpreter and the artifact)."""
    named = dict(model.named_parameters())
    missing = [k for k in graph.params if k not in named]
    if missing:
        raise IRError(f"graph parameter {missing[0]!r} is not a parameter of the model")
    return {k: named[k].detach() for k in graph.params}


def graph_inputs(model: K3ForCausalLM, tokens: torch.Tensor, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """Interpreter inputs for `tokens` [B,T] and a model cache (`model.new_cache` when None)."""
    cache = cache if cache is not None else model.new_cache(tokens.shape[0], tokens.device)
    return {"tokens": tokens, **{k: v for k, v in cache.items() if k != "pos"}}


__all__ = ["ENTRIES", "SAMPLE", "build_meta_model", "graph_inputs", "graph_params", "import_model"]
