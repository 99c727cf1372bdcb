"""Whole-step CUDA graphs for decode: one graph replays every launch of a decode step.

A decode step is a few hundred launches of a few microseconds of GPU work each, so launched one by one from Python
it is bound by the host, not the GPU. A CUDA graph replays a recorded sequence of launches with one driver call,
but it fixes every shape, address and scalar argument. Most of a decode step has them fixed already: weights, the
arena at the plan's offsets and the KDA state pools do not move, and their shapes depend on the batch B only.
What depends on the context length L (attention over the latent-KV cache, the DSA indexer over its keys, the two
cache appends) takes it from device memory instead: the session keeps the context of each sequence in an i32 [B]
tensor (`Session.lengths`), a frame with device lengths binds the pools whole (at the bound L = max_seq − 1), the
attention and indexer kernels size their grids by that bound and split / mask by the row's length read on the
device, and the appends write at the device-side position (`k3c.runtime.frame`). The step ends with an in-graph
increment of the lengths, so replaying the graph is one whole decode step, with no host copy and no launch outside
it (the launches that read the lengths: `length_dependent`).

One graph per batch size, captured after the first eager step at that size (Triton JIT and cuBLAS setup cannot
happen inside a capture); capturing runs nothing, so the caches and lengths are untouched. A replay copies the
tokens into the captured input buffer and replays the graph on the current stream.
"""

from __future__ import annotations

import torch

from k3c.runtime.dims import symbols
from k3c.runtime.frame import Frame

#: kinds of launch that can read the context length from device memory, and the backends that implement that
DEVICE_LENGTH_KINDS = {"mla_attention": ("triton",), "dsa_index_topk": ("triton",), "cache_append": ("view",)}


def _mentions(ln: dict, types: dict, name: str) -> bool:
    """Whether launch `ln` has a value shape or a dim attribute depending on size `name`."""
    dims = [d for v in (*ln["inputs"], *ln["outputs"]) if v in types for d in types[v]["shape"]]
    for k in ln.get("dim_attrs", []):
        a = ln["attrs"].get(k)
        dims.extend(a if isinstance(a, list) else [a])
    return any(name in symbols(d) for d in dims)


def length_dependent(entry: dict) -> list[bool]:
    """For each launch of a schedule entry ({"values", "launches"}), whether it depends on the context length: a
    value shape or dim attribute mentions L, or it is a cache append."""
    types = entry["values"]
    return [ln["kind"] == "cache_append" or _mentions(ln, types, "L") for ln in entry["launches"]]


def device_lengths_supported(entry: dict) -> bool:
    """Whether every context-dependent launch of `entry` can read the context from device memory (a kind and backend
    of DEVICE_LENGTH_KINDS); else the entry runs with host lengths and without CUDA graphs (e.g. TVM kernels)."""
    return all(ln["backend"] in DEVICE_LENGTH_KINDS.get(ln["kind"], ())
               for ln, dep in zip(entry["launches"], length_dependent(entry)) if dep)


class DecodeGraph:
    """The decode step of `session` at batch `B` captured as one CUDA graph (module docstring), lengths increment
    included. `replay(tokens)` runs one step and returns the logits value ([B,1,vocab], the arena's buffer: copy
    it). `greedy`: the graph ends by writing the argmax of its logits into its own token input (`tokens`, int64
    [B,1]), so replaying it again is the next greedy step with nothing done on the host (`Session.generate`)."""

    def __init__(self, session, B: int, greedy: bool = False):
        sched = session.schedule["decode"]
        lengths = session.lengths[:B]
        self.tokens = torch.zeros((B, 1), dtype=torch.int64, device=session.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(session.device)):
            # the frame inside the capture: its append positions (lengths + t) are recomputed by every replay, in
            # the graph's own memory pool, which lives as long as the graph
            frame = Frame(session, "decode", B, 1, session.max_seq - 1, lengths)
            frame.env["tokens"] = self.tokens
            for ln in sched["launches"]:
                frame.launch(ln)
            lengths.add_(1)
            if greedy:
                torch.argmax(frame.env[sched["outputs"]["logits"]], dim=-1, out=self.tokens)
        self.logits = frame.env[sched["outputs"]["logits"]]

    def replay(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of `tokens` int64 [B,1] at the sequences' current lengths (`tokens` may be this graph's
        own `tokens`: no copy); returns the logits buffer."""
        if tokens.data_ptr() != self.tokens.data_ptr():
            self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
