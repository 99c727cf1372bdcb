"""Pass `absorb_mla`: every MLA attention core becomes one `mla_attention` node, absorbed where cheaper.

Decode (T == 1) always runs absorbed: kv_b_proj's key part is folded into the query and its value part into the
output, so attention is MQA over the cached 576-value latent. Prefill takes the form with fewer FLOPs at the
compile bounds (`ctx.bounds`), unless the naive form's decompressed K/V would exceed 4 GiB. The matching, the
cost model and both forms live in `k3c.passes.mla_forms` (shared with `place_dsa`); see its docstring for the
exact patterns (K3-SPEC.md "Gated MLA").
"""

from __future__ import annotations

from k3c.context import CompileContext
from k3c.ir.graph import Graph
from k3c.passes.mla_forms import lower_mla_layers
from k3c.passes.pipeline import register_pass


@register_pass("absorb_mla")
def absorb_mla(graph: Graph, ctx: CompileContext) -> Graph:
    """Pass `absorb_mla` (module docstring), the form chosen automatically at `ctx.bounds`."""
    lower_mla_layers(graph, ctx.bounds)
    return graph
