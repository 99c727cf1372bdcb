"""bind_caches: the functional cache updates become writes into persistent pools.

The imported graph extends each KV / index-key cache functionally: `new_cache = cat(cache_in, rows, dim=1)`, with
`cache_in` a graph input and `new_cache` the graph output of the same name. This pass turns every such `cat` into
`cache_append(cache_in, rows)`, which the runtime executes by writing only the new rows into the pool that backs
the cache (K3-SPEC.md "Sizes to check a memory plan against": the latent KV pool is the model's largest buffer, so
it must never be copied). With FP8 index keys (`--dsa-index-keys fp8`) the keys' scales are a third appended cache,
`layers.i.index_k_scale` [B, L] (`k3c.frontend.index_keys`; `fp8-rerank`: a fourth, the residuals
`layers.i.index_k_lo` [B, L, D/2]). KDA states need no rewrite: `kda_fused` returns the new state and conv state, which the
runtime binds to the same pool buffers as the inputs (updated in place).

A cache output that is not produced this way raises IRError naming it: the runtime could not keep it in a pool.
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.errors import IRError
from k3c.ir.graph import Graph, Node
from k3c.passes.pipeline import register_pass

STATE_SUFFIXES = (".kda_state", ".conv_state")
APPEND_SUFFIXES = (".kv", ".index_k", ".index_k_scale", ".index_k_lo")   # FP8 index keys' scales, residuals


@register_pass("bind_caches")
def bind_caches(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `bind_caches` (module docstring); in place, returns `graph`."""
    inputs = {v.name: v for v in graph.inputs}
    for name, out in list(graph.outputs.items()):
        if name.endswith(STATE_SUFFIXES):
            node = graph.producer(out)
            if node is None or node.op != "kda_fused":
                raise IRError(f"bind_caches: cache output {name} is not the state of a kda_fused node "
                              f"(run fuse_kda first); the runtime updates KDA states in place")
        elif name.endswith(APPEND_SUFFIXES):
            node = graph.producer(out)
            if node is None or node.op not in ("cat", "cache_append") or not node.inputs or \
                    node.inputs[0] is not inputs.get(name):
                raise IRError(f"bind_caches: cache output {name} is not an append to input {name}")
            if node.op == "cat":
                if len(node.inputs) != 2 or node.attrs["dim"] % out.type.rank != 1:
                    raise IRError(f"bind_caches: {name} is built by a cat that is not (cache, rows) along dim 1")
                _to_append(graph, node)
    return graph


def _to_append(graph, node: Node) -> None:
    (new,) = graph.add_node("cache_append", list(node.inputs), {"dim": 1}, name_hint=node.output.name + ".append",
                            meta={**node.meta, "pass": "bind_caches"}, before=node)
    graph.replace_all_uses(node.output, new)
    for k, v in list(graph.outputs.items()):
        if v is node.output:
            graph.outputs[k] = new
    graph.remove_node(node)
