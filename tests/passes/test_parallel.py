"""The parallel phase (shard_tp, shard_experts, split_allreduce): the split graph, run on simulated ranks by
`interpret_ranks`, gives the unsplit graph's outputs; its structure is what the K3 report's AttnRes split needs; the
per-rank weight shards add up to the TP=1 weights; a tp that does not divide the model is refused."""

from __future__ import annotations

import pytest
import torch

from k3c.context import CompileContext
from k3c.errors import ConfigError
from k3c.frontend import import_model
from k3c.ir.interp import interpret
from k3c.ir.interp_ranks import interpret_ranks
from k3c.parallel import Split, cache_split, check_layout, communication, param_split
from k3c.passes.derived import materialize_params
from k3c.passes.pipeline import random_inputs, run_pipeline
from models.config import K3Config
from models.k3 import K3ForCausalLM

#: one entry point per preset keeps the imports few; both entries and all presets are covered across the cases;
#: k3-tiny's prefill is MLA's naive form (cat(k_nope, expand(k_pe)) over the heads), the others' are absorbed
ENTRY = {"k3-tiny": "decode", "k3.1-pro-tiny": "prefill", "kimi-linear-tiny": "decode", "k3-tiny/prefill": "prefill"}
CTX = CompileContext(max_batch=3, max_seq=64, max_prefill=16)
PARALLEL = {"parallel": ["shard_tp", "shard_experts", "split_allreduce"]}


@pytest.fixture(scope="session")
def model_graph():
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            model = K3ForCausalLM(K3Config.from_pretrained(name.split("/")[0])).eval()
            ctx = CTX.for_entry(ENTRY[name])
            g, _ = run_pipeline(import_model(model, ENTRY[name]), ["cleanup", "model"], ctx=ctx, verify="end")
            cache[name] = model, g
        return cache[name]

    return get


def _split(g, name, tp, ep):
    out, _ = run_pipeline(g, PARALLEL, ctx=CTX.for_entry(ENTRY[name]).replace(tp=tp, ep=ep))
    return out


def _conv_shard(t, tp, r):
    """conv_state [B, 3·C, K] holds q, k, v channels one after the other; a rank keeps its block of each."""
    return torch.cat([x.chunk(tp, 1)[r] for x in t.chunk(3, 1)], 1)


def _shard_input(name, t, tp, r):
    if name.endswith(".conv_state"):
        return _conv_shard(t, tp, r)
    s = cache_split(name)
    return t.chunk(tp, s.dim)[r] if s.sharded else t


def _unshard_output(name, outs, tp):
    if name.endswith(".conv_state"):
        return torch.cat([torch.cat([o[name].chunk(3, 1)[j] for o in outs], 1) for j in range(3)], 1)
    s = cache_split(name)
    return torch.cat([o[name] for o in outs], s.dim) if s.sharded else outs[0][name]


@pytest.mark.parametrize("name,tp,ep", [(n, tp, ep) for n in list(ENTRY)[:3] for tp, ep in [(2, 1), (4, 4)]]
                         + [("k3-tiny/prefill", 4, 4)])
def test_split_graph_on_simulated_ranks_equals_tp1(model_graph, name, tp, ep):
    model, g = model_graph(name)
    gt = _split(g, name, tp, ep)
    named = {k: p.detach() for k, p in model.named_parameters()}
    b = {"B": 3, "T": 1 if ENTRY[name] == "decode" else 5, "L": 4 if ENTRY[name] == "decode" else 0}
    inputs, _ = random_inputs(g, b, seed=1)
    want = interpret(g, inputs, materialize_params(g, named), bindings=b)
    ins = [{k: _shard_input(k, t, tp, r) for k, t in inputs.items()} for r in range(tp)]
    outs = interpret_ranks(gt, ins, [materialize_params(gt, named, rank=r) for r in range(tp)], bindings=b)
    for k, t in want.items():
        got = _unshard_output(k, outs, tp)
        assert float((got - t).abs().max() / t.abs().max().clamp_min(1e-30)) <= 1e-5, k
    for r in range(1, tp):  # every rank ends with the same logits
        assert torch.equal(outs[r]["logits"], outs[0]["logits"])


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_split_structure(model_graph, name):
    _, g = model_graph(name)
    gt = _split(g, name, 2, 2)
    ops = [n.op for n in gt.nodes]
    # no all-reduce is left in front of a merge, a norm or a residual add: all became reduce-scatters over tokens
    assert "all_reduce" not in ops and ops.count("reduce_scatter_tokens") > 0
    # AttnRes runs on token shards: its blocks are [1, n, D]
    assert all(n.inputs[1].type.shape[0] == 1 for n in gt.nodes if n.op in ("attn_res_inter",))
    # every reduce-scatter reaches an all-gather before any op that needs whole tokens
    for rs in (n for n in gt.nodes if n.op == "reduce_scatter_tokens"):
        todo, seen, gathered = [rs.output], set(), False
        while todo:
            v = todo.pop()
            for u in gt.users(v):
                if u.op == "all_gather_tokens":
                    gathered = True
                elif id(u) not in seen:
                    seen.add(id(u))
                    assert u.op in ("add", "sub", "mul", "div", "rms_norm", "attn_res_inter", "attn_res_merge"), u
                    todo.extend(u.outputs)
        assert gathered, rs
    # decode at max_batch 3 over 4 ranks: a rank would get less than one token, so the all-reduces stay
    few = [n.op for n in _split(g, name, 4, 4).nodes]
    assert "reduce_scatter_tokens" not in few and few.count("all_reduce") == ops.count("reduce_scatter_tokens")
    # tp = ep = 1: the phase changes nothing
    same = _split(g, name, 1, 1)
    assert [n.op for n in same.nodes] == [n.op for n in g.nodes]


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 1)])
def test_rank_shards_add_up_to_the_tp1_weights(model_graph, tp, ep):
    model, g = model_graph("k3-tiny")
    gt = _split(g, "k3-tiny", tp, ep)
    named = {k: p.detach() for k, p in model.named_parameters()}
    ranks = [materialize_params(gt, named, rank=r) for r in range(tp)]
    full = materialize_params(g, named)
    table = gt.derived_params
    checked = 0
    for key in gt.params:
        rec = table.get(key, {})
        if rec.get("op") == "shard":
            src = rec["from"][0]
            assert param_split(src, ep).dim == rec["attrs"]["dim"]
            assert torch.equal(torch.cat([w[key] for w in ranks], rec["attrs"]["dim"]), full[src]), key
            checked += 1
        elif rec.get("op") == "vocab_shard":  # each rank's rows plus its zero row
            assert all(not w[key][-1].any() for w in ranks)
            assert torch.equal(torch.cat([w[key][:-1] for w in ranks]), named[rec["from"][0]])
            checked += 1
        elif rec.get("op") == "local_index":  # each global row is local to exactly one rank
            hits = sum(((w[key] >= 0) & (w[key] < named[rec["from"][0]].shape[0] // tp)).long() for w in ranks)
            assert torch.equal(hits, torch.ones_like(hits)), key
    assert checked > 50


def test_layout_refuses_what_does_not_divide():
    cfg = K3Config.from_pretrained("k3-tiny")
    with pytest.raises(ConfigError, match="--tp 3 does not divide num_attention_heads = 4"):
        check_layout(cfg, 3)
    with pytest.raises(ConfigError, match="--tp 8 does not divide num_attention_heads"):
        check_layout(cfg, 8)
    with pytest.raises(ConfigError, match="--ep 2: expected 1"):
        check_layout(cfg, 4, 2)
    check_layout(cfg, 4, 4)
    # MXFP4 experts split over their width cut whole 32-value scale groups only: I = 32 is one group
    check_layout(cfg, 2, 1)
    with pytest.raises(ConfigError, match=r"--tp 2 does not divide moe_intermediate_size / 32 .*--ep 2\) = 1"):
        check_layout(cfg, 2, 1, "mxfp4")
    check_layout(cfg, 2, 2, "mxfp4")


def test_communication_counts_the_split(model_graph):
    _, g = model_graph("k3-tiny")
    gt = _split(g, "k3-tiny", 2, 1)
    c = communication(gt, {"B": 2, "T": 1, "L": 8}, 2)
    # 2 tokens over 2 ranks: one row per rank; a ring reduce-scatter sends (g-1) rows, an all-reduce 2(g-1)/g of
    # the 2 rows, f32
    widths = [x.inputs[0].type.shape[-1] for x in gt.nodes if x.op == "reduce_scatter_tokens"]
    assert c["bytes_by_op"]["reduce_scatter_tokens"] == sum(widths) * 4
    gathered = [x.output.type.shape[-1] for x in gt.nodes if x.op == "all_gather_tokens"]
    assert c["bytes_by_op"]["all_gather_tokens"] == sum(gathered) * 4
    logits = 2 * 1 * 512 * 4 // 2  # all_gather of the vocabulary halves
    assert c["plain_allreduce_bytes"] == sum(widths) * 2 * 4 + logits
    assert c["saving_bytes"] == c["plain_allreduce_bytes"] - c["bytes"]
    assert c["attn_res_state_bytes_not_duplicated"] > 0


def test_mxfp4_experts_split_like_their_dense_weights():
    moe = "model.layers.3.block_sparse_moe.experts"
    for part in ("", ".weight_packed", ".weight_scale"):
        assert param_split(f"{moe}.w1{part}", 1) == param_split(f"{moe}.w3{part}", 1) == Split("column", 1)
        assert param_split(f"{moe}.w2{part}", 1) == Split("row", 2)
        assert param_split(f"{moe}.w2{part}", 4) == Split("experts", 0)
