"""FP8 DSA index keys at import (`--dsa-index-keys fp8` / `fp8-rerank`, `CompileContext.dsa_index_keys`).

The reference model keeps every DSA layer's indexer keys in the model's dtype: `keys = cat(cache, k_norm(wk(x)))`,
scored by `dsa_index_topk(q_I, w, keys)` and returned as the new cache. With FP8 keys the cache is two values,
`layers.i.index_k` f8e4m3 [B,L,D] and `layers.i.index_k_scale` f32 [B,L] (one scale per key: DeepSeek-V3.2's FP8
indexer cache, K3-SPEC.md "Gated DSA"), and the layer becomes

    k8_new, s_new = fp8_quantize(k_norm(wk(x)))                     # amax / 448 per key (`fp8_quantize_ref`)
    k8 = cat(k8_cache, k8_new, dim=1);  s = cat(s_cache, s_new, dim=1)
    idx = dsa_index_topk(q_I, w, k8, s)                              # e4m3 scan (`dsa_index_topk_ref`)

so a key is quantized once, when it is appended, and every later call (prefill chunk or decode step) scores the
same e4m3 bits: prefill and decode agree. With `fp8-rerank` the quantizer is `fp8_split` (a power-of-two scale, and
a third cache `layers.i.index_k_lo` u8 [B,L,D/2] of 4-bit low residuals, appended the same way) and the indexer
`dsa_index_topk(q_I, w, k8, s, lo) {rerank = DSA_RERANK_EXTRA}`: the e4m3 scan's topk + E best re-ranked by their
joined keys' exact scores (196 B per token at D = 128; the scan still reads 132). The option lives in the values'
dtypes from here on (no pass branches on it): `bind_caches` turns the cats into pool appends, the memory plan and
the runtime size the pools from the graph's inputs, and the kernels dispatch on k_I's dtype. With `fp8` no exact keys are kept (no re-ranking): the
cache is 132 instead of 256 bytes per token at D = 128 (BENCHMARKS.md "FP8 index keys in the compiled model").
"""

from __future__ import annotations

from k3c.context import DSA_RERANK_EXTRA
from k3c.errors import IRError
from k3c.ir.graph import Graph, Value
from k3c.ir.types import TensorType


def scale_type(keys: TensorType) -> TensorType:
    """The scale cache's type for an index-key cache [B, L, D]: f32 [B, L]."""
    return TensorType(tuple(keys.shape[:2]), "f32")


def lo_type(keys: TensorType) -> TensorType:
    """The residual cache's type for an index-key cache [B, L, D]: u8 [B, L, D / 2] (two 4-bit residuals a byte)."""
    return TensorType((*keys.shape[:2], keys.shape[2] // 2), "u8")


def placeholder(g: Graph, k8: Value, dtype: str, layer: int) -> Value:
    """What the imported mixer reads as its index-key cache (a `cast` of the e4m3 cache to the model's `dtype`);
    `quantize_appended_keys` replaces its one use and removes it."""
    meta = {"source": "k3c.frontend.index_keys (placeholder, removed after the layer's import)", "layer": layer,
            "pass": "import"}
    return g.add_node("cast", [k8], {"to": dtype}, name_hint=f"l{layer}.index_k_in", meta=meta)[0]


def quantize_appended_keys(g: Graph, layer: int, k8: Value, scale: Value, keys: Value,
                           lo: Value | None = None) -> tuple[Value, ...]:
    """Rewrite layer `layer`'s imported key append `keys = cat(placeholder(k8), rows, dim=1)` and its indexer
    (module docstring); returns the new caches (k8 f8e4m3 [B,L+T,D], scale f32 [B,L+T][, lo u8 [B,L+T,D/2]: with
    the residual cache `lo`, `fp8-rerank`]).

    Raises IRError when the layer does not have that form (the cache read other than by the append, or the keys
    read other than by `dsa_index_topk`)."""
    cat = g.producer(keys)
    ph = cat.inputs[0] if cat is not None and cat.op == "cat" and len(cat.inputs) == 2 else None
    ph_node = g.producer(ph) if ph is not None else None
    if ph_node is None or ph_node.op != "cast" or ph_node.inputs[0] is not k8 or len(g.users(ph)) != 1 or \
            cat.attrs["dim"] % keys.type.rank != 1:
        raise IRError(f"layers.{layer}.index_k: --dsa-index-keys fp8 needs the new keys as cat(cache, rows, dim=1) "
                      f"read only by dsa_index_topk")
    users = g.users(keys)
    if not users or any(u.op != "dsa_index_topk" or u.inputs[2] is not keys or len(u.inputs) != 3 for u in users):
        raise IRError(f"layers.{layer}.index_k: the keys are read other than as dsa_index_topk's k_i")
    how = "e4m3 keys, one f32 scale per key" + (", 4-bit residuals (fp8-rerank)" if lo is not None else "")
    meta = {"source": f"k3c.frontend.index_keys (--dsa-index-keys: {how})", "layer": layer, "pass": "import"}
    parts = g.add_node("fp8_quantize" if lo is None else "fp8_split", [cat.inputs[1]],
                       name_hint=f"l{layer}.index_k_fp8", meta=meta, before=cat)
    caches = [k8, scale] + ([lo] if lo is not None else [])
    new = [g.add_node("cat", [c, r], {"dim": 1}, name_hint=f"l{layer}.index_k{suffix}", meta=meta, before=cat)[0]
           for c, r, suffix in zip(caches, parts, ("", "_scale", "_lo"))]
    for u in users:
        attrs = {**u.attrs, "rerank": DSA_RERANK_EXTRA} if lo is not None else u.attrs
        (idx,) = g.add_node("dsa_index_topk", [*u.inputs[:2], *new], attrs, name_hint=u.outputs[0].name,
                            meta={**u.meta, "pass": "import"}, before=u)
        g.replace_all_uses(u.outputs[0], idx)
        g.remove_node(u)
    g.remove_nodes([cat, ph_node])
    return tuple(new)
