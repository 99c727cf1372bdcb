"""lower_attn_res: Block AttnRes in the two-phase form (one attn_res_inter per block, one attn_res_merge per read)."""

from __future__ import annotations

import torch

from k3c.context import CompileContext
from k3c.ir.graph import Graph
from k3c.ir.interp import interpret
from k3c.ir.types import TensorType
from k3c.ir.verify import verify
from k3c.passes.lower_attn_res import lower_attn_res
from k3c.passes.pipeline import run_pipeline
from test_absorb_mla import assert_same_outputs, imported, prefix_cache, rel_err, run_graph, tiny_model, tokens

D = 8


def _direct(g: Graph, sources: list, qv, eps: float = 1e-5):
    """The canonical direct AttnRes read, as the frontend + cleanup emit it."""
    S = g.add("cat", *[g.add("unsqueeze", s, dim=0) for s in sources], dim=0)
    lg = g.add("sum", g.add("mul", g.add("rms_norm", S, eps=eps), qv), dims=[-1])
    w = g.add("unsqueeze", g.add("softmax", lg, dim=0), dim=-1)
    return g.add("sum", g.add("mul", w, S), dims=[0])


def small_graph() -> Graph:
    """Two sealed blocks b0, b1; three reads over them (partials p1, p2, p3) and one over b0 alone."""
    g = Graph()
    b0, b1, p1, p2, p3 = (g.add_input(n, TensorType(("B", "T", D), "f32")) for n in ("b0", "b1", "p1", "p2", "p3"))
    qs = []
    for i in range(4):
        nw, pw = g.add_param(f"r{i}.norm.weight", TensorType((D,), "f32")), g.add_param(
            f"r{i}.proj.weight", TensorType((1, D), "f32"))
        qs.append((nw, pw))

    def q(i):
        return g.add("mul", qs[i][0], g.add("select", qs[i][1], dim=0, index=0))

    g.set_output("h0", _direct(g, [b0, p1], q(0)))
    h1 = _direct(g, [b0, b1, p1], q(1))
    g.set_output("h1", h1)
    g.set_output("h2", _direct(g, [b0, b1, g.add("add", p2, h1)], q(2)))
    g.set_output("h3", _direct(g, [b0, b1, p3], q(3)))  # its query is computed late: hoisted before the inter
    return g


def _random(g: Graph, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ins = {v.name: torch.randn(3, 5, D, generator=gen) for v in g.inputs}
    params = {k: torch.randn(*[int(d) for d in v.type.shape], generator=gen) for k, v in g.params.items()}
    return ins, params


def test_small_graph_before_expected():
    g = small_graph()
    after, _ = run_pipeline(g, {"model": ["lower_attn_res"]})
    ops = [n.op for n in after.nodes]
    assert ops.count("attn_res_inter") == 2 and ops.count("attn_res_merge") == 4
    assert "softmax" not in ops and "rms_norm" not in ops
    inters = [n for n in after.nodes if n.op == "attn_res_inter"]
    assert [len(n.inputs) - 1 for n in inters] == [1, 2]  # sealed blocks seen
    assert [n.inputs[0].type.shape[0] for n in inters] == [1, 3]  # queries: 1 read over b0, 3 over b0, b1
    merges = [n for n in after.nodes if n.op == "attn_res_merge"]
    assert [n.attrs["index"] for n in merges] == [0, 0, 1, 2]
    pos = {id(n): i for i, n in enumerate(after.nodes)}
    assert pos[id(inters[1])] < min(pos[id(m)] for m in merges[1:])
    ins, params = _random(g)
    want, got = interpret(g, ins, params), interpret(after, ins, params)
    for k in want:
        assert rel_err(got[k], want[k]) <= 1e-5, k


def test_small_graph_wrong_rewrite_is_caught():
    """The numeric check can fail: swapping two merges' query indices changes the outputs."""
    g = small_graph()
    after, _ = run_pipeline(g, {"model": ["lower_attn_res"]})
    merges = [n for n in after.nodes if n.op == "attn_res_merge"]
    merges[1].attrs["index"], merges[2].attrs["index"] = 1, 0
    ins, params = _random(g)
    want, got = interpret(g, ins, params), interpret(after, ins, params)
    assert rel_err(got["h1"], want["h1"]) > 1e-3


def test_k3_tiny_structure():
    """Blocks of 3 layers, 10 layers: seals at 0, 3, 6, 9 -> 4 blocks with sealed blocks; 21 reads, of which
    layer 0's attention read sees no sealed block (it is the embedding itself)."""
    g = imported("k3-tiny", "prefill")
    after = lower_attn_res(g.copy(), CompileContext())
    verify(after)
    inters = [n for n in after.nodes if n.op == "attn_res_inter"]
    merges = [n for n in after.nodes if n.op == "attn_res_merge"]
    assert len(inters) == 4 and len(merges) == 20
    assert [len(n.inputs) - 1 for n in inters] == [1, 2, 3, 4]
    assert [n.inputs[0].type.shape[0] for n in inters] == [6, 6, 6, 2]  # last block: l9 mlp read + final readout
    assert not any(n.op == "softmax" and n.inputs[0].type.rank == 3 for n in after.nodes)
    pos = {id(n): i for i, n in enumerate(after.nodes)}
    for m in merges:  # each merge reads the inter of its block, computed earlier
        assert pos[id(after.producer(m.inputs[0]))] < pos[id(m)]
    assert len({id(after.producer(m.inputs[0])) for m in merges}) == 4


def test_k3_tiny_prefill_exact_batch_1_and_3():
    model, g = tiny_model("k3-tiny"), imported("k3-tiny", "prefill")
    after, _ = run_pipeline(g, {"model": ["lower_attn_res"]})
    for B in (1, 3):
        tok = tokens(model, B, 8, seed=B)
        want, got = run_graph(g, model, tok), run_graph(after, model, tok)
        assert_same_outputs(want, got, tol=1e-5)


def test_k3_tiny_decode_exact():
    model, g = tiny_model("k3-tiny"), imported("k3-tiny", "decode")
    after, _ = run_pipeline(g, {"model": ["lower_attn_res"]})
    assert sum(n.op == "attn_res_inter" for n in after.nodes) == 4
    cache, tok = prefix_cache(model, 3, 6), tokens(model, 3, 1)
    assert_same_outputs(run_graph(g, model, tok, cache), run_graph(after, model, tok, cache), tol=1e-5)


def test_no_attn_res_in_kimi_linear():
    g = imported("kimi-linear-tiny", "decode")
    after = lower_attn_res(g.copy(), CompileContext())
    assert len(after.nodes) == len(g.nodes)
