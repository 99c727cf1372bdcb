"""Views of a graph for drawing and export: one layer's nodes, or the whole model collapsed to one block per layer.

A `Block` is a set of nodes shown as one unit, with the values that enter it (`inputs`: read by its nodes,
produced elsewhere: by another block, a graph input or a parameter) and leave it (`outputs`: produced by its nodes
and read by another block or a graph output), each in first-use order. `collapse(g)` gives one block per run of
consecutive nodes of one `meta["layer"]` and one block per node outside any layer (embedding, final norm, head),
in schedule order; `layer_block(g, n)` is all of layer n. A layer is usually one run, but passes may hoist a
layer's parameter-only work (e.g. AttnRes key norms) ahead of earlier layers: that work is a run of its own
("layer_1.0" before "layer_1"), which keeps the collapsed graph acyclic, in schedule order. The blocks of
`collapse` cover every node exactly once, so block-level dataflow is the graph's dataflow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from k3c.errors import ConfigError
from k3c.ir.graph import Graph, Node, Value


@dataclass
class Block:
    """Nodes drawn or exported as one unit (see the module docstring); `layer` is None for a lone node."""

    name: str
    layer: int | None
    nodes: list[Node]
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)


def layers(graph: Graph) -> list[int]:
    """The distinct `meta["layer"]` values of the graph's nodes, sorted."""
    return sorted({n.meta["layer"] for n in graph.nodes if n.meta.get("layer") is not None})


def _finish(graph: Graph, blocks: list[Block]) -> list[Block]:
    """Fill each block's inputs and outputs from the graph's dataflow."""
    owner: dict[Value, int] = {}
    for i, b in enumerate(blocks):
        for n in b.nodes:
            for v in n.outputs:
                owner[v] = i
    leaving: dict[int, dict[Value, None]] = {i: {} for i in range(len(blocks))}
    for i, b in enumerate(blocks):
        seen: dict[Value, None] = {}
        for n in b.nodes:
            for v in n.inputs:
                j = owner.get(v)
                if j != i:
                    seen.setdefault(v)
                    if j is not None:
                        leaving[j].setdefault(v)
        b.inputs = list(seen)
    for v in graph.outputs.values():
        if v in owner:
            leaving[owner[v]].setdefault(v)
    for i, b in enumerate(blocks):
        order = {v: k for k, v in enumerate(v for n in b.nodes for v in n.outputs)}
        b.outputs = sorted(leaving[i], key=order.__getitem__)
    return blocks


def collapse(graph: Graph) -> list[Block]:
    """Blocks of consecutive nodes of one layer, and one block per node outside the layers, in schedule order."""
    runs: list[list[Node]] = []
    for n in graph.nodes:
        layer = n.meta.get("layer")
        if layer is not None and runs and runs[-1][0].meta.get("layer") == layer:
            runs[-1].append(n)
        else:
            runs.append([n])
    count = Counter(r[0].meta.get("layer") for r in runs)
    seen: Counter = Counter()
    blocks = []
    for i, r in enumerate(runs):
        layer = r[0].meta.get("layer")
        if layer is None:
            blocks.append(Block(f"{r[0].op}_{i}", None, r))
            continue
        seen[layer] += 1
        last = seen[layer] == count[layer]  # the layer's main run is its last: hoisted work comes first
        blocks.append(Block(f"layer_{layer}" if last else f"layer_{layer}.{seen[layer] - 1}", layer, r))
    return _finish(graph, blocks)


def layer_block(graph: Graph, layer: int) -> Block:
    """Layer `layer` as one block; raises `ConfigError` naming the layers there are when it has no nodes."""
    nodes = [n for n in graph.nodes if n.meta.get("layer") == layer]
    if not nodes:
        have = layers(graph)
        span = f"{have[0]}..{have[-1]}" if have else "none"
        raise ConfigError(f"--layer {layer}: no IR node belongs to that layer (layers: {span})")
    return _finish(graph, [Block(f"layer_{layer}", layer, nodes)])[0]


def block_label(block: Block) -> str:
    """A one-line description of a layer block: its name, node count and the model ops that characterise it,
    e.g. "layer 3: 35 nodes; kda_fused, moe_experts" or "layer 8.0: 4 nodes" (a hoisted run)."""
    model = sorted({n.op for n in block.nodes if n.op in MODEL_OPS_SHOWN})
    return f"{block.name.replace('_', ' ')}: {len(block.nodes)} nodes" + (f"; {', '.join(model)}" if model else "")


#: ops that characterise a layer in a collapsed view (mixer and FFN kinds)
MODEL_OPS_SHOWN = frozenset({"kda_fused", "kda_recurrence", "mla_attention", "dsa_index_topk", "moe_experts",
                             "moe_route", "attn_res_merge", "causal_conv1d"})
