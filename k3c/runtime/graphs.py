"""Piecewise CUDA graphs for decode: the launches that do not depend on the context length are replayed as graphs.

A decode step is a few hundred launches of a few microseconds of GPU work each, so it is bound by the host (Python
and driver launch costs), not by the GPU. A CUDA graph replays a recorded stretch of launches with one driver call,
but it fixes every shape and address. Most of a decode step has them fixed already: weights, the arena at the plan's
offsets and the KDA state pools do not move, and their shapes depend on the batch B only. What does depend on the
context length L (attention over the KV cache, the DSA indexer over its keys, the cache appends) cannot be
recorded once. So the schedule is cut into pieces, as vLLM's piecewise CUDA graphs cut a model around attention:

    [graph: launches 0..i) ] [eager: L-dependent launch i] [graph: i+1..j) ] [eager: j] ...

A launch runs eagerly when a shape or attribute of it mentions L, when it is a cache append, or when it reads a
value that an eager launch produced outside the arena (such a value may move between steps). One set of graphs is
captured per batch size, after one eager step at that size (Triton JIT and cuBLAS setup cannot happen inside a
capture); capturing runs nothing, so the caches are untouched. A replay copies the tokens into the captured input
buffer, replays the graphs and runs the eager launches in order on the current stream.
"""

from __future__ import annotations

import torch

from k3c.runtime.dims import symbols
from k3c.runtime.frame import Frame


def _mentions(ln: dict, types: dict, name: str) -> bool:
    """Whether launch `ln` has a value shape or a dim attribute depending on size `name`."""
    dims = [d for v in (*ln["inputs"], *ln["outputs"]) if v in types for d in types[v]["shape"]]
    for k in ln.get("dim_attrs", []):
        a = ln["attrs"].get(k)
        dims.extend(a if isinstance(a, list) else [a])
    return any(name in symbols(d) for d in dims)


def eager_launches(schedule: dict, offsets: dict) -> list[bool]:
    """For each launch of the decode schedule, whether it must run eagerly (module docstring)."""
    types, launches = schedule["values"], schedule["launches"]
    eager = [ln["kind"] == "cache_append" or _mentions(ln, types, "L") for ln in launches]
    producer = {v: i for i, ln in enumerate(launches) for v in ln["outputs"]}
    changed = True
    while changed:  # a value an eager launch leaves outside the arena has no fixed address: its readers run eagerly
        changed = False
        for i, ln in enumerate(launches):
            if not eager[i] and any(v in producer and eager[producer[v]] and v not in offsets for v in ln["inputs"]):
                eager[i] = changed = True
    return eager


class DecodeGraphs:
    """The decode schedule of a session at batch `B`, captured as CUDA graphs between its eager launches.

    Captured at context length `L` (any value: recorded launches do not depend on it). `replay(tokens, L)` runs one
    decode step at context length L and returns the logits value ([B,1,vocab], the arena's buffer: copy it).
    """

    def __init__(self, session, B: int, L: int):
        self.session, self.B = session, B
        sched = session.schedule["decode"]
        self.launches, self.logits = sched["launches"], sched["outputs"]["logits"]
        self.eager = eager_launches(sched, session.offsets["decode"])
        frame = Frame(session, "decode", B, 1, L)
        self.tokens = torch.zeros((B, 1), dtype=torch.int64, device=session.device)
        frame.env["tokens"] = self.tokens
        self.pieces: list[torch.cuda.CUDAGraph | int] = []  # a graph, or the index of an eager launch
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(session.device)
        run: list[dict] = []

        def close():
            if run:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    for ln in run:
                        frame.launch(ln)
                self.pieces.append(graph)
                run.clear()

        for i, ln in enumerate(self.launches):
            if self.eager[i]:
                close()
                self.pieces.append(i)
                for v in ln["outputs"]:  # bind the eager launch's fixed buffers for the recorded readers
                    buf = frame.out(v)
                    if buf is not None:
                        frame.env[v] = buf
            else:
                run.append(ln)
        close()
        self.env = frame.env  # the recorded tensors: the graphs read and write exactly these

    @property
    def graph_count(self) -> int:
        return sum(isinstance(p, torch.cuda.CUDAGraph) for p in self.pieces)

    def replay(self, tokens: torch.Tensor, L: int) -> torch.Tensor:
        """One decode step of `tokens` int64 [B,1] at context length L; returns the logits buffer."""
        self.tokens.copy_(tokens)
        frame = Frame(self.session, "decode", self.B, 1, L)
        frame.env.update({k: v for k, v in self.env.items() if k not in frame.env})
        for piece in self.pieces:
            if isinstance(piece, int):
                frame.launch(self.launches[piece])
            else:
                piece.replay()
        return frame.env[self.logits]
