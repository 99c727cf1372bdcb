"""What `k3c compile --report` keeps for the HTML report, under the artifact's `report/` directory.

    report/passes.json        {entry: [{step, name, phase, nodes, ops: {op: count}, ir}]}: the input and every
                              pass, `ir` naming the file with the IR text after that step
    report/<entry>/NN-NAME.txt  the IR text (`k3c.ir.printer`) after step NN (00 is the imported graph)
    report/kernels.json       {entry: [{name, backend, generated, kind, layer, ir_nodes, flops, bytes, roofline_s,
                              bound}]}:
                              one row per launch of schedule.json, in order
    report/options.json       the compile options that shape the artifact

FLOPs and bytes of a launch are the sums of its IR nodes' costs (each op's registered cost function, evaluated at
the compile bounds; bytes count every node's reads and writes, so a fused kernel's figure is an upper bound on its
memory traffic); `roofline_s` and `bound` are `k3c.targets.roofline` on the compile target at the artifact's
dtype with measured figures where the target has them. Nothing here depends on time or the machine: the same
compile writes the same files.
"""

from __future__ import annotations

import json
from collections import Counter

from k3c.ir.graph import Graph
from k3c.ir.kernels import KernelGroup
from k3c.ir.ops import get_op
from k3c.ir.printer import print_graph
from k3c.ir.types import evaluate
from k3c.passes.pipeline import Observer, PassRecord
from k3c.targets import Target, roofline


class PassLog:
    """Collects, per entry point, each pipeline step's node counts and IR text (an `observe` for run_pipeline)."""

    def __init__(self) -> None:
        self.steps: dict[str, list[dict]] = {}
        self.texts: dict[str, str] = {}

    def observer(self, entry: str) -> Observer:
        """The `observe` callback recording `entry`'s steps."""
        rows = self.steps.setdefault(entry, [])

        def observe(rec: PassRecord, graph: Graph) -> None:
            path = f"report/{entry}/{len(rows):02d}-{rec.name}.txt"
            self.texts[path] = print_graph(graph)
            ops = Counter(n.op for n in graph.nodes)
            rows.append({"step": len(rows), "name": rec.name, "phase": rec.phase, "nodes": len(graph.nodes),
                         "ops": dict(sorted(ops.items())), "ir": path})

        return observe


def kernel_rows(groups: list[KernelGroup], bindings: dict[str, int], target: Target, dtype: str,
                generating: set[str]) -> list[dict]:
    """One row per kernel group (launch order): backend, whether that backend generates code (a name in
    `generating`, e.g. triton, tvm; not library or view), kind, layer, IR nodes, FLOPs, bytes, roofline seconds."""
    memo: dict[tuple, tuple[int, int]] = {}
    rows = []
    for group in groups:
        flops = nbytes = 0
        for n in group.nodes:
            ins, outs = tuple(v.type for v in n.inputs), tuple(v.type for v in n.outputs)
            key = (n.op, json.dumps(n.attrs, sort_keys=True), ins, outs)
            if key not in memo:
                f, b = get_op(n.op).cost(n.attrs, list(ins), list(outs))
                memo[key] = evaluate(f, bindings), evaluate(b, bindings)
            flops += memo[key][0]
            nbytes += memo[key][1]
        layers = sorted({n.meta["layer"] for n in group.nodes if n.meta.get("layer") is not None})
        r = roofline(flops, nbytes, target, dtype, measured=True)
        rows.append({"name": group.name, "backend": group.backend, "generated": group.backend in generating,
                     "kind": group.kind,
                     "layer": layers[0] if len(layers) == 1 else None, "ir_nodes": group.ir_nodes,
                     "flops": flops, "bytes": nbytes, "roofline_s": r.time_s, "bound": r.bound})
    return rows


def report_files(log: PassLog, kernels: dict[str, list[dict]], options: dict) -> dict[str, object]:
    """The `report/` files: relative path -> text (IR) or JSON data (see the module docstring)."""
    files: dict[str, object] = dict(sorted(log.texts.items()))
    files["report/passes.json"] = log.steps
    files["report/kernels.json"] = kernels
    files["report/options.json"] = options
    return files
