"""The frontend: the reference model (`models/k3.py`) -> torch.export -> k3c IR.

    graph = import_model("k3.1-pro", entry="decode")          # full model on the meta device: no weights
    graph = import_model(model, entry="prefill")              # a loaded K3ForCausalLM
    graph = import_model(model, entry="prefill", logits="last")   # the lm_head on the last position only

The prefill entry (T symbolic) is exported; the decode entry is the same graph specialised to T = 1 (the model
computes one function for any T, so one export serves both). With `logits="last"` the head's inputs are sliced to
row T-1 before it: a caller continuing the sequence needs no other row, and [B,T,vocab] logits are the largest
buffer of a long prefill (the compiled artifact's `prefill` entry is built so). Each distinct sublayer (AttnRes read,
token mixer of each kind, dense MLP, MoE) is exported once (`segments.py`) and instantiated for every use (`fx_import.py`), with
parameters bound to the layer's own keys and the AttnRes block count N bound to the number of sealed blocks at that
point; `import_model` joins the pieces as `K3DecoderLayer.forward` does (AttnRes read -> mixer -> residual add or
seal -> AttnRes read -> MLP -> residual add; Kimi Linear: mixer and MLP on a plain residual stream).
The result is one graph with:
- inputs: `tokens` i64 [B,T] (T is 1 for decode), then the cache: per layer `layers.i.kda_state` [B,H,K,K] in
  the storage dtype `kda_state` (f32 by default), `layers.i.conv_state` [B,3HK,W] in the q/k/v projections'
  dtype (`conv_state_dtype`: bf16 in a bf16 model, exact for the raw projection outputs it holds), `layers.i.kv`
  [B,L,kv_lora_rank+rope], `layers.i.index_k` [B,L,Dk];
- params: keyed by the reference model's parameter names (the checkpoint key without `language_model.`;
  routed experts stacked as `...experts.w1` [E,I,D]);
- outputs: `logits` [B,T,vocab] ([B,1,vocab] with `logits="last"`) and the new cache entries under the same names
  as the inputs.
With `kda_state="bf16"` the state is stored in bf16 and computed in f32, as the model computes it: each KDA
layer reads `cast(state, f32)` and its new state is `cast(new_state, bf16)`, rounded once per call (`fuse_kda`
folds both casts into `kda_fused`). A bf16 conv state is read and written through casts the same way.
With `dsa_index_keys="fp8"` every DSA layer's `layers.i.index_k` is f8e4m3 [B,L,Dk] with a second cache
`layers.i.index_k_scale` f32 [B,L]: the appended keys are quantized once and the indexer scores e4m3 keys
(`k3c.frontend.index_keys`); "fp8-rerank" adds a third, `layers.i.index_k_lo` u8 [B,L,Dk/2] (4-bit residuals).
The cache's token count `pos` is kept by the runtime (the K3 family is NoPE: no op reads positions).
Imported graphs are memoised on disk (`cache.py`, keyed by the config, parameter types and the importing code):
torch.export runs only for a model this code has not imported before.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from k3c.context import check_dsa_index_keys, check_kda_state
from k3c.errors import IRError, UnsupportedError
from k3c.frontend import cache as memo
from k3c.frontend import index_keys
from k3c.ir.graph import Graph, Value
from k3c.ir.specialize import specialize
from k3c.ir.types import TensorType, dtype_of, symbol, torch_dtype
from models.config import K3Config
from models.k3 import K3ForCausalLM

ENTRIES = ("prefill", "decode")


def build_meta_model(cfg: K3Config | str) -> K3ForCausalLM:
    """The reference model on the meta device (no memory for weights)."""
    cfg = cfg if isinstance(cfg, K3Config) else K3Config.from_pretrained(cfg)
    with torch.device("meta"):
        return K3ForCausalLM(cfg)


def import_model(model: K3ForCausalLM | K3Config | str, entry: str = "prefill",
                 progress: Callable[[int, int], None] | None = None, stats: dict | None = None,
                 logits: str = "all", kda_state: str = "f32", dsa_index_keys: str = "bf16") -> Graph:
    """Import `model` (a module, a config or a preset/config path) into a k3c graph for `entry`.

    logits: "all" (every position's, as the model returns them) or "last" (the last position's: the head runs on
    that row only; the same for decode, where T = 1). kda_state: the KDA state's storage dtype ("f32" | "bf16";
    `CompileContext.kda_state_dtype`, see the module docstring). dsa_index_keys: the DSA index-key cache's
    storage ("bf16" | "fp8" | "fp8-rerank"; `CompileContext.dsa_index_keys`, see the module docstring). progress(done, total) is called per layer; stats
    (if given) receives timings in seconds and node counts.
    The graph is memoised on disk (`k3c.frontend.cache`): a model imported before by the same code is read back
    (stats["cached"] is True then, and progress is called once).
    Raises ConfigError (bad config, kda_state or dsa_index_keys), UnsupportedError (an op without a lowering, naming the model line).
    """
    check_kda_state(kda_state)
    check_dsa_index_keys(dsa_index_keys)
    if entry not in ENTRIES:
        raise UnsupportedError(f"entry point must be one of {', '.join(ENTRIES)}, found {entry!r}")
    if logits not in ("all", "last"):
        raise UnsupportedError(f"logits must be 'all' or 'last', found {logits!r}")
    if isinstance(model, K3ForCausalLM):
        cfg, params = model.config, [(k, str(p.dtype), list(p.shape)) for k, p in model.named_parameters()]
    else:
        cfg, params = model if isinstance(model, K3Config) else K3Config.from_pretrained(model), "meta"
    if entry == "decode":  # decode is prefill at T = 1: one export serves both entry points
        build = lambda: specialize(import_model(model, "prefill", progress, stats,  # noqa: E731
                                                kda_state=kda_state, dsa_index_keys=dsa_index_keys),
                                   {"T": 1}, pass_name="import(decode)")
    else:
        build = lambda: _import_prefill(model if params != "meta" else build_meta_model(cfg),  # noqa: E731
                                        progress, stats, logits, kda_state, dsa_index_keys)
    t0 = time.perf_counter()
    graph, hit = memo.memoized(memo.key(cfg.raw, cfg.name, params, entry, logits, kda_state,
                                                     dsa_index_keys), build)
    if hit:
        if progress:
            progress(cfg.num_hidden_layers, cfg.num_hidden_layers)
        if stats is not None:
            stats.update(export_s=0.0, import_s=time.perf_counter() - t0, nodes=len(graph.nodes), segments=0,
                         cached=True)
    return graph


def _import_prefill(model: K3ForCausalLM, progress, stats: dict | None, logits: str, kda_state: str,
                    index_k: str) -> Graph:
    """The prefill graph of `import_model`, not memoised: export the pieces (`segments.py`), import them
    (`fx_import.py`) and join them."""
    from k3c.frontend.fx_import import FxImporter  # torch.export: only when the graph is not memoised
    from k3c.frontend.segments import export_segments, ffn_segment, layer_cache_keys, mixer_segment

    cfg = model.config
    t0 = time.perf_counter()
    segs = export_segments(model)
    t1 = time.perf_counter()
    g = Graph()
    tokens = g.add_input("tokens", TensorType(("B", "T"), "i64"))
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
            cache_in[name] = g.add_input(name, _cache_type(model, i, k, kda_state, index_k))
            if k == "index_k" and index_k != "bf16":
                cache_in[name + "_scale"] = g.add_input(name + "_scale", index_keys.scale_type(cache_in[name].type))
            if k == "index_k" and index_k == "fp8-rerank":
                cache_in[name + "_lo"] = g.add_input(name + "_lo", index_keys.lo_type(cache_in[name].type))
    im = FxImporter(g)
    subs_memo: dict[tuple, dict] = {}

    def run(seg_name: str, ins: list[Value], params, layer: int | None, hint: str, n_blocks: int | None = None,
            rows: int | None = None):
        seg = segs[seg_name]
        if (seg_name, n_blocks, rows) not in subs_memo:
            subs_memo[seg_name, n_blocks, rows] = _subs(seg, n_blocks, rows)
        source = "models/k3.py (K3DecoderLayer.forward: AttnRes read)" if seg_name == "attn_res" else ""
        return im.run(seg.program, ins, params, subs_memo[seg_name, n_blocks, rows], layer, hint, source)

    # the layer-level nodes (AttnRes reads, residual adds) are named `l<i>.layer.<n>`, as in a whole-layer export
    def attn_res_read(i: int, kind: str, blocks: Value, partial: Value, n_blocks: int) -> tuple[Value, Value]:
        bind = lambda fqn: param(f"model.layers.{i}.{kind}_res_{fqn}")  # noqa: E731  (proj.weight, norm.weight)
        return run("attn_res", [blocks, partial], bind, i, f"l{i}.layer", n_blocks)

    def residual_add(a: Value, b: Value, i: int) -> Value:
        meta = {"source": "models/k3.py (K3DecoderLayer.forward: residual add)", "layer": i, "pass": "import"}
        return g.add_node("add", [a, b], name_hint=f"l{i}.layer", meta=meta)[0]

    attn_res = cfg.attn_res_block_size is not None
    (h,) = run("embed", [tokens], lambda fqn: param("model." + fqn), None, "embed")
    blocks = g.add_node("zeros", [], {"shape": [0, "B", "T", cfg.hidden_size], "dtype": h.type.dtype},
                        name_hint="attn_res.blocks0")[0] if attn_res else None
    n_blocks = 0
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for key, _ in model.model.layers[i].named_parameters():  # every parameter of the layer, in module order
            param(prefix + key)
        layer_param = lambda fqn, prefix=prefix: param(prefix + fqn[len("layer."):])  # noqa: E731
        keys = layer_cache_keys(model, i)
        fp8_keys = index_k != "bf16" and "index_k" in keys
        caches = [_state_cast(g, cache_in[f"layers.{i}.{k}"], "f32", i, k) if k in _F32_INSIDE else
                  index_keys.placeholder(g, cache_in[f"layers.{i}.{k}"], dtype_of(model.dtype), i)
                  if k == "index_k" and fp8_keys else cache_in[f"layers.{i}.{k}"] for k in keys]
        if attn_res:  # K3DecoderLayer.forward: AttnRes read, mixer, seal or add, AttnRes read, MLP, add
            x, sources = attn_res_read(i, "self_attention", blocks, h, n_blocks)
            out, *new = run(mixer_segment(model, i), [x] + caches, layer_param, i, f"l{i}")
            if cfg.seals_block(i):  # blocks.append(partial); partial = out
                blocks, h, n_blocks = sources, out, n_blocks + 1
            else:
                h = residual_add(h, out, i)
            x, _ = attn_res_read(i, "mlp", blocks, h, n_blocks)
            (y,) = run(ffn_segment(model, i), [x], layer_param, i, f"l{i}")
            h = residual_add(h, y, i)
        else:  # Kimi Linear: plain residual stream
            out, *new = run(mixer_segment(model, i), [h] + caches, layer_param, i, f"l{i}")
            h = residual_add(h, out, i)
            (y,) = run(ffn_segment(model, i), [h], layer_param, i, f"l{i}")
            h = residual_add(h, y, i)
        if fp8_keys:
            j, name = keys.index("index_k"), f"layers.{i}.index_k"
            new[j], *extra = index_keys.quantize_appended_keys(g, i, cache_in[name], cache_in[name + "_scale"], new[j],
                                                               cache_in.get(name + "_lo"))
        for k, v in zip(keys, new):
            g.set_output(f"layers.{i}.{k}", _state_cast(g, v, cache_in[f"layers.{i}.{k}"].type.dtype, i, k)
                         if k in _F32_INSIDE else v)
        for suffix, v in zip(("_scale", "_lo"), extra if fp8_keys else ()):
            g.set_output(f"layers.{i}.index_k{suffix}", v)
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
    head_param = lambda fqn: param(fqn if fqn.startswith("lm_head") else "model." + fqn)  # noqa: E731
    rows = None
    if logits == "last":  # the head (final AttnRes read, norm, lm_head) on the last position only
        h, blocks, rows = _last_row(g, h, 1), _last_row(g, blocks, 2) if attn_res else None, 1
    (logits,) = run("head", [h] + ([blocks] if attn_res else []), head_param, None, "head", n_blocks, rows)
    g.set_output("logits", logits)
    g.outputs = {"logits": g.outputs.pop("logits"), **g.outputs}
    if stats is not None:
        stats.update(export_s=t1 - t0, import_s=time.perf_counter() - t1, nodes=len(g.nodes), segments=len(segs),
                     cached=False)
    return g


# KDA caches the model computes in f32 but the graph may store narrower: the recurrent state (`kda_state`, the
# --kda-state option) and the conv state (raw projected inputs, stored in the projections' dtype).
_F32_INSIDE = ("kda_state", "conv_state")


def _state_cast(g: Graph, state: Value, to: str, layer: int, key: str) -> Value:
    """`state` (the layer's cache `key`) as `to`: a `cast` node of `g` where the storage dtype differs (a bf16
    store), else itself."""
    if state.type.dtype == to:
        return state
    meta = {"source": f"k3c.frontend (KDA {key} stored as {state.type.dtype if to == 'f32' else to}, computed "
                      f"in f32)", "layer": layer, "pass": "import"}
    return g.add_node("cast", [state], {"to": to}, name_hint=f"l{layer}.{key}", meta=meta)[0]


def _last_row(g: Graph, x: Value, axis: int) -> Value:
    """x[..., T-1:T, ...] along `axis` (the token axis), as a `slice` node of `g`."""
    meta = {"source": "k3c.frontend (prefill: logits of the last position)", "pass": "import"}
    return g.add_node("slice", [x], {"dim": axis, "start": "T - 1", "end": "T"}, name_hint="head.last", meta=meta)[0]


def _subs(seg, n_blocks: int | None, rows: int | None = None) -> dict:
    """{export symbol -> k3c dim} for one use of `seg`, read off the roles of its placeholders; `rows` (if given)
    replaces T (the head sees one row with `logits="last"`)."""
    base = {"B": symbol("B"), "T": symbol("T") if rows is None else rows, "L": symbol("L")}
    out = {}
    for fx, role in zip(_user_placeholders(seg.program), seg.inputs):
        for ax, sym in zip(fx.meta["val"].shape, _ROLE_AXES[role]):
            if sym is not None and isinstance(ax, torch.SymInt):
                out[ax.node.expr] = n_blocks if sym == "N" else base[sym]
    return out


def _user_placeholders(program):
    user = set(program.graph_signature.user_inputs)
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user]


_ROLE_AXES = {"tokens": ("B", "T"), "h": ("B", "T", None), "partial": ("B", "T", None),
              "blocks": ("N", "B", "T", None), "cache.kv": ("B", "L", None), "cache.index_k": ("B", "L", None),
              "cache.kda_state": ("B", None, None, None), "cache.conv_state": ("B", None, None)}


def _cache_type(model: K3ForCausalLM, i: int, key: str, kda_state: str, index_k: str) -> TensorType:
    """The graph input type of layer i's cache `key`. The conv state holds raw q/k/v projection outputs, so it
    is stored in the projections' dtype (exact; bf16 halves the bytes each decode step moves)."""
    cfg = model.config
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    dt = dtype_of(model.dtype)
    if key == "conv_state":
        return TensorType(("B", 3 * H * K, W), conv_state_dtype(model, i))
    return {"kda_state": TensorType(("B", H, K, K), kda_state),
            "kv": TensorType(("B", "L", cfg.mla_cache_width), dt),
            "index_k": TensorType(("B", "L", cfg.index_head_dim), "f8e4m3" if index_k != "bf16" else dt)}[key]


def conv_state_dtype(model: K3ForCausalLM, i: int) -> str:
    """The IR dtype layer i's KDA conv state is stored in: its q projection's weight dtype (the raw inputs the
    state holds are that projection's outputs), f32 for any other weight dtype."""
    dt = dtype_of(model.model.layers[i].self_attn.q_proj.weight.dtype)
    return dt if dt in ("bf16", "f16") else "f32"


def graph_params(model: K3ForCausalLM, graph: Graph) -> dict[str, torch.Tensor]:
    """The model's tensors for every parameter of `graph` (for the interpreter and the artifact)."""
    named = dict(model.named_parameters())
    missing = [k for k in graph.params if k not in named]
    if missing:
        raise IRError(f"graph parameter {missing[0]!r} is not a parameter of the model")
    return {k: named[k].detach() for k in graph.params}


def graph_inputs(model: K3ForCausalLM, tokens: torch.Tensor, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """Interpreter inputs for `tokens` [B,T] and a model cache (`model.new_cache` when None; its f32 conv states
    are converted to the graph's storage dtype, `conv_state_dtype`: exact, they hold projection outputs)."""
    cache = cache if cache is not None else model.new_cache(tokens.shape[0], tokens.device)
    out = {"tokens": tokens}
    for k, v in cache.items():
        if k.endswith(".conv_state"):
            v = v.to(torch_dtype(conv_state_dtype(model, int(k.split(".")[1]))))
        if k != "pos":
            out[k] = v
    return out


__all__ = ["ENTRIES", "build_meta_model", "conv_state_dtype", "graph_inputs", "graph_params", "import_model"]
