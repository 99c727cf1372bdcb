"""The pass manager: named phases of named passes, composed in one place (TVM Relax `pipeline.py` style).

A pass is a function `(Graph, CompileContext) -> Graph` registered with `@register_pass("name")`; it may mutate
the graph it is given and return it, or return a new graph. Options (target, dtype, bounds, tp, backends) reach it
only through the context (`k3c/context.py`). Pass modules register themselves on import; `load_passes()` imports
every module of `k3c.passes` named in `PHASES`, so a new pass only needs its file plus its name below.

    cleanup   dce, cse, canonicalize              generic cleanup and canonical patterns
    model     pack_experts, fuse_kda, lower_moe, lower_attn_res, absorb_mla, place_dsa, fold_params,
              canonicalize, dce           (canonicalize again: the lowerings leave cast round trips behind)
    parallel  shard_tp, shard_experts, split_allreduce   (no-ops at tp = 1; `k3c.parallel` is the layout)
    kernels   fuse_gemms, bind_caches, sink_views, form_kernels
    memory    plan_memory

A name that no module registers is an `IRError` naming the registered passes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3c.context import CompileContext
from k3c.errors import IRError, K3CError
from k3c.ir.graph import Graph
from k3c.ir.interp import interpret
from k3c.ir.printer import print_graph
from k3c.ir.types import FLOAT_DTYPES, evaluate, torch_dtype
from k3c.ir.verify import verify as verify_graph

Pass = Callable[[Graph, CompileContext], Graph]

#: The compilation, phase by phase. Edit here to add, reorder or drop a pass.
PHASES: dict[str, list[str]] = {
    "cleanup": ["dce", "cse", "canonicalize"],
    "model": ["pack_experts", "fuse_kda", "lower_moe", "lower_attn_res", "absorb_mla", "place_dsa", "fold_params",
              "canonicalize", "dce"],
    "parallel": ["shard_tp", "shard_experts", "split_allreduce"],
    "kernels": ["fuse_gemms", "bind_caches", "sink_views", "form_kernels"],
    "memory": ["plan_memory"],
}

_PASSES: dict[str, Pass] = {}


def register_pass(name: str) -> Callable[[Pass], Pass]:
    """Decorator registering `fn` as pass `name`; raises `IRError` if another function already has the name."""
    def deco(fn: Pass) -> Pass:
        prev = _PASSES.get(name)
        if prev is not None and (prev.__module__, prev.__qualname__) != (fn.__module__, fn.__qualname__):
            raise IRError(f"pass {name!r} is registered twice ({prev.__module__} and {fn.__module__})")
        _PASSES[name] = fn
        return fn

    return deco


def load_passes() -> None:
    """Import the modules `k3c.passes.<name>` of every pass named in `PHASES` that exists (they register)."""
    for names in PHASES.values():
        for name in names:
            mod = f"k3c.passes.{name}"
            if name not in _PASSES and importlib.util.find_spec(mod) is not None:
                importlib.import_module(mod)


def get_pass(name: str) -> Pass:
    """The registered pass `name`; raises `IRError` listing the registered ones."""
    load_passes()
    try:
        return _PASSES[name]
    except KeyError:
        raise IRError(f"no pass named {name!r} (registered: {', '.join(sorted(_PASSES))})") from None


def registered_passes() -> dict[str, Pass]:
    load_passes()
    return dict(_PASSES)


@dataclass
class PassRecord:
    """One pass run: name, phase, wall seconds, node counts, the dump file (if any)."""

    name: str
    phase: str
    seconds: float
    nodes_before: int
    nodes_after: int
    dump: str | None = None


@dataclass
class PipelineReport:
    """What `run_pipeline` did: pass records in order, total seconds."""

    passes: list[PassRecord] = field(default_factory=list)
    seconds: float = 0.0

    def table(self) -> str:
        """A plain-text timing table, one pass per line."""
        rows = [f"{r.phase:<9} {r.name:<16} {r.seconds * 1e3:9.1f} ms  {r.nodes_before:>6} -> {r.nodes_after:<6}"
                for r in self.passes]
        return "\n".join(rows + [f"total {self.seconds * 1e3:.1f} ms"])


NumericCheck = Callable[[Graph, Graph, str], None]
Observer = Callable[["PassRecord", Graph], None]


def _plan(phases) -> list[tuple[str, str]]:
    if phases is None:
        phases = list(PHASES)
    if isinstance(phases, dict):
        return [(ph, p) for ph, names in phases.items() for p in names]
    out = []
    for ph in phases:
        if ph not in PHASES:
            raise IRError(f"unknown phase {ph!r} (phases: {', '.join(PHASES)})")
        out += [(ph, p) for p in PHASES[ph]]
    return out


def run_pipeline(graph: Graph, phases: list[str] | dict[str, list[str]] | None = None, *,
                 ctx: CompileContext | None = None, until: str | None = None,
                 verify: str = "each", dump_dir: str | Path | None = None,
                 numeric_check: NumericCheck | None = None,
                 observe: Observer | None = None) -> tuple[Graph, PipelineReport]:
    """Run the passes of `phases` (phase names from `PHASES`, or an explicit {phase: [pass names]}) in order.

    `ctx`: the compile context handed to every pass (None: `CompileContext()`, f32 at the default bounds), resolved
    (target loaded, backends chosen) before the first pass; it should name the entry point (`ctx.for_entry`).

    The caller's graph is copied first and never changed. `until`: stop after the first pass of that name.
    `verify`: "each" runs the verifier on the input and after every pass (`IRError` names the pass); "end" only on
    the result (`k3c compile`: on a full-size model, verifying after every pass costs more than the passes
    themselves; rerun with "each" to find the pass at fault); "off" never. `dump_dir` (or env `K3C_DUMP`): write
    `00-input.txt`, then `NN-pass.txt` after every pass. `numeric_check(before, after, pass_name)` is called after
    every pass and should raise naming the pass (see `make_numeric_check`). `observe(record, graph)` is called
    with the input (a record named "input") and after every pass; it must not change the graph (the compile report
    keeps each pass's IR this way, `k3c.report.collect`).
    Returns (final graph, report with per-pass timings).
    """
    t0 = time.perf_counter()
    ctx = (ctx or CompileContext()).resolve()
    load_passes()
    dump = Path(dump_dir or os.environ.get("K3C_DUMP") or "") if (dump_dir or os.environ.get("K3C_DUMP")) else None
    if verify not in ("each", "end", "off"):
        raise IRError(f"verify={verify!r}: expected 'each', 'end' or 'off'")
    g = graph.copy()
    if verify == "each":
        verify_graph(g)
    report = PipelineReport()
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "00-input.txt").write_text(print_graph(g))
    if observe is not None:
        observe(PassRecord("input", "import", 0.0, len(g.nodes), len(g.nodes)), g)
    step = 0
    for phase, name in _plan(phases):
        fn = get_pass(name)
        step += 1
        before = g.copy() if numeric_check is not None else None
        n0 = len(g.nodes)
        ts = time.perf_counter()
        g = fn(g, ctx)
        if not isinstance(g, Graph):
            raise IRError(f"pass {name} returned {type(g).__name__}, not a Graph")
        secs = time.perf_counter() - ts
        rec = PassRecord(name, phase, secs, n0, len(g.nodes))
        if dump is not None:
            path = dump / f"{step:02d}-{name}.txt"
            path.write_text(print_graph(g))
            rec.dump = str(path)
        report.passes.append(rec)
        if verify == "each":
            try:
                verify_graph(g)
            except IRError as e:
                raise IRError(f"after pass {name}: {e}") from None
        if numeric_check is not None:
            numeric_check(before, g, name)
        if observe is not None:
            observe(rec, g)
        if until is not None and name == until:
            break
    if verify == "end":
        try:
            verify_graph(g)
        except IRError as e:
            raise IRError(f"after the pipeline: {e} (verify='each' names the pass)") from None
    report.seconds = time.perf_counter() - t0
    return g, report


# ---- random inputs and the numeric check -------------------------------------------------------------------------
def random_inputs(graph: Graph, bindings: dict[str, int], seed: int = 0, *, scale: float = 0.5,
                  int_high: int = 4) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random (inputs by name, params by key) for `interpret`, shapes evaluated under `bindings`.

    Floats: N(0, scale²); bool: fair coins; integers: uniform in [0, high) where high is the smallest size an
    `embedding`/`index_select`/`gather` reading the value indexes into, else `int_high`. Deterministic in `seed`.
    """
    gen = torch.Generator().manual_seed(seed)
    highs = _index_bounds(graph, bindings)

    def make(v):
        shape = v.type.concrete_shape(bindings)
        dt = v.type.dtype
        if dt in FLOAT_DTYPES:
            return (torch.randn(shape, generator=gen) * scale).to(torch_dtype(dt))
        if dt == "bool":
            return torch.rand(shape, generator=gen) < 0.5
        return torch.randint(0, highs.get(v, int_high), shape, generator=gen).to(torch_dtype(dt))

    return ({v.name: make(v) for v in graph.inputs}, {k: make(v) for k, v in graph.params.items()})


def _index_bounds(graph: Graph, bindings: dict[str, int]) -> dict:
    out: dict = {}
    for n in graph.nodes:
        if n.op == "embedding":
            v, size = n.inputs[1], n.inputs[0].type.shape[0]
        elif n.op in ("index_select", "gather"):
            v, size = n.inputs[1], n.inputs[0].type.shape[n.attrs["dim"]]
        else:
            continue
        high = evaluate(size, bindings)
        out[v] = min(out.get(v, high), high)
    return out


_TOL = {"f32": (1e-4, 1e-4), "bf16": (2e-2, 2e-2), "f16": (2e-3, 2e-3), "f8e4m3": (1.3e-1, 1.3e-1)}


def make_numeric_check(bindings: dict[str, int], seed: int = 0,
                       tolerances: dict[str, tuple[float, float]] | None = None,
                       params: dict[str, torch.Tensor] | None = None) -> NumericCheck:
    """A `numeric_check` for `run_pipeline`: interpret before and after a pass on the same random inputs.

    Float outputs must agree within (rtol, atol) per dtype (`tolerances` overrides the defaults: f32 1e-4,
    bf16 2e-2), FP8 key residual nibbles (`.index_k_lo`) within one unit (or wrapped with their e4m3 step), others
    exactly. Raises `IRError` naming the pass and the first differing output. Inputs and
    params are drawn from the graph before the pass (a pass may drop unused params; extra ones are ignored).
    `params` (checkpoint key -> tensor, e.g. a model's weights) replaces the random parameters: realistic weights
    keep activations O(1), so fp32 rounding differences between equivalent forms stay within the tolerance; it may
    also hold the parameters a pass introduces (e.g. pack_experts' MXFP4 experts).
    """
    from k3c.passes.derived import materialize_params

    given = params
    tol = {**_TOL, **(tolerances or {})}

    def check(before: Graph, after: Graph, pass_name: str) -> None:
        ins, params = random_inputs(before, bindings, seed)
        if given is not None:
            params = materialize_params(before, given)
        want = interpret(before, ins, params, bindings=bindings)
        try:
            got = interpret(after, ins, materialize_params(after, {**(given or {}), **params}), bindings=bindings)
        except K3CError as e:
            raise IRError(f"pass {pass_name}: the graph after it fails to run: {e}") from None
        if set(got) != set(want):
            raise IRError(f"pass {pass_name} changed the graph outputs: {sorted(want)} -> {sorted(got)}")
        for k in want:
            a, b = want[k], got[k]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise IRError(f"pass {pass_name} changed output {k!r}: {a.dtype}{list(a.shape)} -> "
                              f"{b.dtype}{list(b.shape)}")
            dt = after.outputs[k].type.dtype
            if dt in tol:
                rtol, atol = tol[dt]
                ok = torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True)
            elif k.endswith(".index_k_lo"):    # fp8-rerank's 4-bit key residuals, two a byte: each may move by one
                d = torch.stack([(a.int() & 15) - (b.int() & 15), (a.int() >> 4) - (b.int() >> 4)]).abs()
                ok = bool(((d <= 1) | (d >= 14)).all())   # unit, or wrap with its e4m3 step (f8e4m3's tolerance)
            else:
                ok = torch.equal(a, b)
            if not ok:
                diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()
                raise IRError(f"pass {pass_name} changed output {k!r} numerically (max abs diff {diff:.3g})")

    return check
