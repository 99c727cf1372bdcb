"""Pass `canonicalize`: Before/Expected rewrites on small graphs, no decomposed norm left in any tiny preset,
interpreter outputs unchanged, linear running time.

Also holds the helpers the KDA / MoE pass tests share (imported tiny models and graphs, cached per session:
each preset is imported once, decode is the prefill graph specialised to T = 1 as in `import_model`).
"""

from __future__ import annotations

import functools
import time
from collections import Counter

import pytest
import torch

from k3c.frontend import graph_inputs, graph_params, import_model
from k3c.ir import Graph, TensorType
from k3c.ir.interp import interpret
from k3c.passes.canonicalize import canonicalize_in_place
from k3c.passes.pipeline import run_pipeline
from k3c.ir.printer import format_node
from models.config import K3Config, _shrink, _TINY_COMMON
from models.k3 import K3ForCausalLM

TINY = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")
CLEANUP = {"cleanup": ["dce", "cse", "canonicalize"]}


# ---- shared helpers (also used by test_fuse_kda.py and test_lower_moe.py) ------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors: intra-op threads only add barrier waits (100x on a loaded 2-core machine). Restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small_config(name: str, base: str = "k3", layers: int = 4, kda_layers=(1, 2, 4), heads: int = 4,
                 head_dim: int = 16, eps: float = 1e-5) -> K3Config:
    """A tiny config derived from a published one (`models.config._shrink`); kda_layers are 1-based."""
    full = [i for i in range(1, layers + 1) if i not in kda_layers]
    over = dict(_TINY_COMMON, num_hidden_layers=layers, rms_norm_eps=eps)
    if base == "kimi-linear-48b":
        over.update(q_lora_rank=None, num_shared_experts=1)
    else:
        over.update(q_lora_rank=32, routed_expert_hidden_size=32, attn_res_block_size=2, num_shared_experts=2)
    lin = dict(kda_layers=list(kda_layers), full_attn_layers=full, num_heads=heads, head_dim=head_dim)
    return _shrink(name, base, linear_attn_config=lin, **over)


def model(name: str, dtype: str = "f32", **cfg) -> K3ForCausalLM:
    """A seeded random model of preset `name` (or `small_config(name, **cfg)` when cfg is given), cached: callers
    must not mutate it."""
    return _model(name, dtype, _hashable(cfg))


@functools.lru_cache(maxsize=None)
def _model(name: str, dtype: str, cfg: tuple) -> K3ForCausalLM:
    conf = small_config(name, **dict(cfg)) if cfg else K3Config.from_pretrained(name)
    m = K3ForCausalLM(conf).init_random_(0)
    if dtype == "bf16":
        m.cast_(torch.bfloat16)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _hashable(cfg: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()))


@functools.lru_cache(maxsize=None)
def _imported(name: str, entry: str, dtype: str, cfg: tuple) -> Graph:
    if entry == "decode":
        try:
            from k3c.ir.specialize import specialize
        except ImportError:  # the frontend may export decode itself
            return import_model(_model(name, dtype, cfg), "decode")
        return specialize(_imported(name, "prefill", dtype, cfg), {"T": 1})
    return import_model(_model(name, dtype, cfg), "prefill")


def imported(name: str, entry: str, dtype: str = "f32", **cfg) -> Graph:
    """The imported graph of `model(name, dtype, **cfg)` for `entry`, cached: callers must not mutate it."""
    return _imported(name, entry, dtype, _hashable(cfg))


def model_inputs(m: K3ForCausalLM, entry: str, batch: int, seed: int = 0):
    """(interpreter inputs, model tokens, model cache): a 3-token prefill fills the caches first, then the entry
    runs T = 5 (prefill) or T = 1 (decode) new tokens on top of them."""
    gen = torch.Generator().manual_seed(seed)
    V = m.config.vocab_size
    _, cache = m(torch.randint(0, V, (batch, 3), generator=gen))
    tokens = torch.randint(0, V, (batch, 5 if entry == "prefill" else 1), generator=gen)
    return graph_inputs(m, tokens, cache), tokens, cache


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def compare(m: K3ForCausalLM, before: Graph, after: Graph, entry: str, batch: int, tol: float = 1e-5) -> dict:
    """Interpret both graphs on the same inputs; every output within rel err `tol`. Returns after's outputs."""
    ins, _, _ = model_inputs(m, entry, batch)
    want = interpret(before, ins, graph_params(m, before))
    got = interpret(after, ins, graph_params(m, after))
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert rel_err(got[k], want[k]) <= tol, (k, rel_err(got[k], want[k]))
    return got


def ops_of(g: Graph, layer: int | None = None) -> Counter:
    return Counter(n.op for n in g.nodes if layer is None or n.meta.get("layer") == layer)


# ---- the tiny presets ------------------------------------------------------------------------------------------
def expected_norms(cfg: K3Config) -> tuple[int, int]:
    """(rms_norm, of which without weight) that the model code computes (K3-SPEC.md), counted from the config."""
    n = cfg.num_hidden_layers
    kda = len(cfg.kda_layers)
    rms = 2 * n + 1 + kda                                   # input / post-attention norms, final norm, KDA o_norm
    rms += (n - kda) * (1 + (cfg.q_lora_rank is not None))  # MLA kv_a_layernorm (+ q_a_layernorm)
    rms += sum(cfg.is_moe(i) for i in range(n)) * (cfg.routed_expert_hidden_size is not None)  # latent norm
    unweighted = (2 * n + 1) if cfg.attn_res_block_size is not None else 0  # AttnRes keys, weight applied later
    return rms + unweighted, unweighted


@pytest.mark.parametrize("name", TINY)
def test_presets_have_no_decomposed_norms(name):
    cfg = model(name).config
    for entry in ("prefill", "decode"):
        g, _ = run_pipeline(imported(name, entry), CLEANUP)
        ops = ops_of(g)
        assert ops["rsqrt"] == ops["pow"] == ops["mean"] == 0, ops
        rms, unweighted = expected_norms(cfg)
        assert ops["rms_norm"] == rms
        assert sum(1 for n in g.nodes if n.op == "rms_norm" and len(n.inputs) == 1) == unweighted
        assert ops["l2norm"] == 2 * len(cfg.kda_layers)
        # the AttnRes seed cat([zeros[0,B,T,D], x]) became x
        assert not any(n.op == "zeros" and 0 in n.attrs["shape"] for n in g.nodes)
        for n in g.nodes:
            if n.op == "cast":
                assert n.inputs[0].type.dtype != n.attrs["to"], format_node(n)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_presets_numerically_unchanged(name, entry):
    before, _ = run_pipeline(imported(name, entry), {"cleanup": ["dce", "cse"]})
    after, _ = run_pipeline(before, {"cleanup": ["canonicalize"]})
    assert len(after.nodes) < 0.8 * len(before.nodes)
    compare(model(name), before, after, entry, batch=2)


def test_bf16_model_casts_fold_into_the_norms():
    """With bf16 weights the RMSNorm module is cast(·, f32) … cast(·, bf16): one rms_norm on the bf16 value."""
    g, _ = run_pipeline(imported("k3-tiny", "decode", "bf16"), CLEANUP)
    weighted = [n for n in g.nodes if n.op == "rms_norm" and len(n.inputs) == 2]
    layer_norms = [n for n in weighted if "layernorm" in n.inputs[1].name and "self_attn" not in n.inputs[1].name]
    assert len(layer_norms) == 2 * 10 and all(n.outputs[0].type.dtype == "bf16" for n in layer_norms)
    assert all(n.inputs[1].type.dtype == "bf16" for n in layer_norms)  # the param itself, not its f32 cast
    compare(model("k3-tiny", "bf16"), imported("k3-tiny", "decode", "bf16"), g, "decode", batch=2, tol=0)


# ---- Before / Expected on small graphs -------------------------------------------------------------------------
def _run(g: Graph) -> tuple[Graph, list[str]]:
    before = g.copy()
    canonicalize_in_place(g)
    return before, [n.op for n in g.nodes]


def _same_outputs(before: Graph, after: Graph, shapes: dict, exact: bool = False) -> None:
    gen = torch.Generator().manual_seed(0)
    ins = {v.name: torch.randn(shapes[v.name], generator=gen).to(_td(v.type.dtype)) for v in before.inputs}
    prm = {k: (1 + 0.1 * torch.randn(shapes[k], generator=gen)).to(_td(v.type.dtype)) for k, v in before.params.items()}
    a = interpret(before, ins, prm)
    b = interpret(after, ins, {k: prm[k] for k in after.params})
    for k in a:
        assert torch.equal(a[k], b[k]) if exact else torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-6), k


def _td(name):
    from k3c.ir.types import torch_dtype

    return torch_dtype(name)


def rms_module(g: Graph, x, w, eps=1e-5, dtype="bf16"):
    """models/layers.py RMSNorm as the frontend writes it: casts, pow, mean, add, rsqrt, mul, mul(weight), cast."""
    xf = g.add("cast", x, to="f32") if dtype != "f32" else x
    r = g.add("rsqrt", g.add("add", g.add("mean", g.add("pow", xf, exponent=2.0), dims=[-1], keepdim=True), scalar=eps))
    wf = g.add("cast", w, to="f32") if w.type.dtype != "f32" else w
    y = g.add("mul", g.add("mul", xf, r), wf)
    return g.add("cast", y, to=dtype) if dtype != "f32" else y


def test_rms_norm_module_with_casts_becomes_one_op():
    g = Graph()
    x = g.add_input("x", TensorType(("B", "T", 8), "bf16"))
    w = g.add_param("norm.weight", TensorType((8,), "bf16"))
    g.set_output("y", rms_module(g, x, w))
    before, ops = _run(g)
    assert ops == ["rms_norm"]
    n = g.nodes[0]
    assert n.inputs == [x, w] and n.attrs["eps"] == 1e-5 and n.outputs[0].type == TensorType(("B", "T", 8), "bf16")
    _same_outputs(before, g, {"x": (2, 3, 8), "norm.weight": (8,)}, exact=True)


def test_unweighted_norms_l2norm_and_what_stays():
    g = Graph()
    v = g.add_input("v", TensorType((3, "B", "T", 8), "f32"))
    mix = g.add_input("mix", TensorType((8,), "f32"))
    q = g.add_input("q", TensorType(("B", "T", 2, 4), "f32"))
    # AttnRes keys: no weight, then a dot with a computed [D] vector (not a param): stays rms_norm(v) * mix
    keys = g.add("mul", v, g.add("rsqrt", g.add("add", g.add("mean", g.add("mul", v, v), dims=[3], keepdim=True),
                                                 scalar=1e-5)))
    g.set_output("logits", g.add("sum", g.add("mul", keys, mix), dims=[-1]))
    # l2norm per head, rsqrt on the left
    s = g.add("rsqrt", g.add("add", g.add("sum", g.add("pow", q, exponent=2.0), dims=[-1], keepdim=True),
                             scalar=1e-6))
    g.set_output("q", g.add("mul", s, q))
    # a norm whose rsqrt is read twice is left alone (rewriting would compute it twice)
    r = g.add("rsqrt", g.add("add", g.add("mean", g.add("pow", q, exponent=2.0), dims=[-1], keepdim=True), scalar=1.0))
    g.set_output("shared", g.add("add", g.add("mul", q, r), r))
    # a norm over a dim other than the last is not an rms_norm
    m0 = g.add("rsqrt", g.add("add", g.add("mean", g.add("pow", v, exponent=2.0), dims=[0], keepdim=True), scalar=1.0))
    g.set_output("dim0", g.add("mul", v, m0))
    before, ops = _run(g)
    c = Counter(ops)
    assert c["rms_norm"] == 1 and c["l2norm"] == 1 and c["rsqrt"] == 2 and c["mean"] == 2
    l2 = next(n for n in g.nodes if n.op == "l2norm")
    assert l2.inputs == [q] and l2.attrs == {"eps": 1e-6, "dim": -1}
    rms = next(n for n in g.nodes if n.op == "rms_norm")
    assert rms.inputs == [v] and g.users(rms.outputs[0])[0].op == "mul"
    _same_outputs(before, g, {"v": (3, 2, 4, 8), "mix": (8,), "q": (2, 4, 2, 4)})


def test_narrow_dtype_chain_is_not_an_rms_norm():
    """The same chain computed in bf16 rounds at every step; the op computes in fp32: no rewrite."""
    g = Graph()
    x = g.add_input("x", TensorType(("T", 8), "bf16"))
    w = g.add_param("w", TensorType((8,), "bf16"))
    r = g.add("rsqrt", g.add("add", g.add("mean", g.add("pow", x, exponent=2.0), dims=[-1], keepdim=True), scalar=1e-5))
    g.set_output("y", g.add("mul", g.add("mul", x, r), w))  # no casts: everything bf16
    _, ops = _run(g)
    assert "rms_norm" not in ops and "rsqrt" in ops


def test_casts_cats_views_silu_softmax_linear():
    g = Graph()
    x = g.add_input("x", TensorType(("B", "T", 8), "bf16"))
    f = g.add_input("f", TensorType(("B", "T", 8), "f32"))
    w = g.add_param("w", TensorType((4, 8), "f32"))
    g.set_output("widen_narrow", g.add("cast", g.add("cast", x, to="f32"), to="bf16"))  # exact round trip -> x
    g.set_output("via_f32", g.add("cast", g.add("cast", x, to="f32"), to="f16"))        # -> cast(x, f16)
    g.set_output("lossy", g.add("cast", g.add("cast", f, to="bf16"), to="f32"))         # rounds: stays
    seed = g.add("zeros", shape=[0, "B", "T", 8], dtype="f32")
    one = g.add("unsqueeze", f, dim=0)
    g.set_output("cat1", g.add("cat", seed, one, dim=0))                                  # -> unsqueeze(f)
    g.set_output("cat2", g.add("cat", seed, one, one, dim=0))                             # -> cat(one, one)
    g.set_output("view", g.add("reshape", g.add("reshape", f, shape=["B*T", 8]), shape=["B", "T", 8]))  # -> f
    g.set_output("silu", g.add("mul", f, g.add("sigmoid", f)))
    e = g.add("exp", g.add("sub", f, g.add("amax", f, dims=[-1], keepdim=True)))
    g.set_output("softmax", g.add("div", e, g.add("sum", e, dims=[-1], keepdim=True)))
    g.set_output("linear", g.add("matmul", f, g.add("transpose", w, dim0=0, dim1=1)))
    before, ops = _run(g)
    out = {k: g.producer(v) for k, v in g.outputs.items()}
    assert g.outputs["widen_narrow"] is x and g.outputs["view"] is f
    assert out["via_f32"].op == "cast" and out["via_f32"].inputs == [x] and out["via_f32"].attrs["to"] == "f16"
    assert out["lossy"].op == "cast" and g.producer(out["lossy"].inputs[0]).op == "cast"
    assert out["cat1"].op == "unsqueeze"
    assert out["cat2"].op == "cat" and len(out["cat2"].inputs) == 2
    assert out["silu"].op == "silu" and out["silu"].inputs == [f]
    assert out["softmax"].op == "softmax" and out["softmax"].attrs["dim"] == -1
    assert out["linear"].op == "linear" and out["linear"].inputs == [f, w]
    assert Counter(ops)["zeros"] == 0 and "exp" not in ops and "transpose" not in ops
    _same_outputs(before, g, {"x": (2, 3, 8), "f": (2, 3, 8), "w": (4, 8)})


def test_running_time_is_linear():
    """Canonicalize is one pass over the nodes per round: 4x the graph costs about 4x (not 16x) the time."""
    def chain_graph(n):
        g = Graph()
        h = g.add_input("x", TensorType(("T", 8), "bf16"))
        for i in range(n):
            h = rms_module(g, h, g.add_param(f"w{i}", TensorType((8,), "bf16")))
        g.set_output("y", h)
        return g

    def secs(n):
        g = chain_graph(n)
        t = time.perf_counter()
        canonicalize_in_place(g)
        dt = time.perf_counter() - t
        assert [n.op for n in g.nodes] == ["rms_norm"] * n
        return dt

    small, big = min(secs(150) for _ in range(2)), min(secs(600) for _ in range(2))
    assert big < 8 * small, (small, big)
