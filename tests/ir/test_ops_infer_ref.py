"""Every registered op: symbolic `infer`, evaluated at concrete dims, matches what its torch `ref` returns."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3c.errors import IRError, UnsupportedError
from k3c.ir.ops import all_ops, get_op
from k3c.ir.types import FLOAT_DTYPES, TensorType, torch_dtype

BIND = {"B": 2, "T": 3, "L": 5, "N": 4, "S": 6}


def tt(shape, dtype="f32"):
    return TensorType(tuple(shape), dtype)


F = tt(("B", "T", 8))
I64 = "i64"
# op -> list of (input types, attrs, {input position: int high}) ; ints are drawn in [0, high)
CASES = {
    **{o: [([F, F], {}, {}), ([tt(("B", 1, 8)), tt((8,))], {}, {}), ([F], {"scalar": 2.0}, {}),
           ([F], {"scalar": 2.0, "reverse": True}, {})] for o in ("add", "sub", "mul", "div", "maximum", "minimum")},
    **{o: [([F, F], {}, {}), ([F], {"scalar": 0.0}, {})] for o in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{o: [([tt(("B", "T"), "bool"), tt((1, "T"), "bool")], {}, {}), ([tt(("T",), "bool")], {"scalar": 1.0}, {})]
       for o in ("logical_and", "logical_or", "logical_xor")},
    **{o: [([F], {}, {})] for o in ("exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh", "silu", "reciprocal", "softplus",
                                    "gelu", "neg", "abs", "relu", "copy", "softmax", "log_softmax")},
    "pow": [([F], {"exponent": 2.0}, {})],
    "logical_not": [([tt(("T",), "bool")], {}, {})],
    "clamp": [([F], {"min": -0.5}, {}), ([tt((4,), "bf16")], {"min": -0.1, "max": 0.2}, {})],
    "cast": [([F], {"to": "bf16"}, {}), ([F], {"to": "i32"}, {})],
    "where": [([tt(("B", "T", 1), "bool"), F, tt((8,))], {}, {})],
    "masked_fill": [([F, tt(("T", 1), "bool")], {"value": float("-inf")}, {})],
    **{o: [([F], {"dims": [1]}, {}), ([F], {"dims": [0, 2], "keepdim": True}, {}), ([F], {}, {})]
       for o in ("sum", "mean", "amax", "amin")},
    "cumsum": [([F], {"dim": 1}, {})],
    "topk": [([F], {"k": 3}, {}), ([F], {"k": "T", "dim": 1, "largest": False}, {})],
    "sort": [([F], {"dim": 1, "descending": True}, {})],
    "argsort": [([F], {}, {})],
    "reshape": [([F], {"shape": ["B*T", 2, 4]}, {}), ([F], {"shape": ["B", -1]}, {})],
    "permute": [([F], {"dims": [2, 0, 1]}, {})],
    "transpose": [([F], {"dim0": 0, "dim1": -1}, {})],
    "expand": [([tt(("B", 1, 8))], {"shape": [3, -1, "T", 8]}, {})],
    "slice": [([tt(("B", "L+T", 8))], {"dim": 1, "start": "L", "end": "L+T"}, {}),
              ([F], {"dim": 2, "start": 1, "step": 3}, {}), ([F], {"dim": 1, "start": -2}, {})],
    "select": [([F], {"dim": 1, "index": "T-1"}, {}), ([F], {"dim": 2, "index": -1}, {})],
    "unsqueeze": [([F], {"dim": -1}, {})],
    "squeeze": [([tt(("B", 1, 8))], {"dims": [1]}, {})],
    "cat": [([tt(("B", "L", 8)), F], {"dim": 1}, {})],
    "stack": [([F, F, F], {"dim": 1}, {})],
    "split": [([tt(("B", "T", 12))], {"sizes": [4, 8], "dim": -1}, {})],
    "pad": [([F], {"pads": [1, 2, 0, "T"], "value": 1.5}, {})],
    "index_select": [([F, tt((5,), I64)], {"dim": 2}, {1: 8})],
    "gather": [([F, tt(("B", "T", 2), I64)], {"dim": 2}, {1: 8})],
    "scatter": [([F, tt(("B", "T", 2), I64), tt(("B", "T", 2))], {"dim": 2, "reduce": "add"}, {1: 8})],
    "embedding": [([tt((10, 8), "bf16"), tt(("B", "T"), I64)], {}, {1: 10})],
    "matmul": [([tt(("B", 1, "T", 8)), tt((3, 8, 5))], {}, {})],
    "linear": [([F, tt((5, 8)), tt((5,))], {}, {}), ([F, tt((5, 8))], {}, {})],
    "conv1d": [([tt(("B", 4, "T")), tt((4, 1, 3))], {"groups": 4, "padding": 2}, {})],
    "arange": [([], {"end": "L+T"}, {}), ([], {"start": 1, "end": 10, "step": 3, "dtype": "f32"}, {})],
    "full": [([], {"shape": ["B", "T"], "value": 3.0, "dtype": "bf16"}, {})],
    "zeros": [([], {"shape": ["T", 2]}, {})],
    "ones": [([], {"shape": [2], "dtype": "i32"}, {})],
    "tril": [([tt(("T", "T"))], {"diagonal": -1}, {})],
    "triu": [([tt(("T", "S"))], {}, {})],
    "constant": [([], {"value": [[1, 2], [3, 4]], "shape": [2, 2], "dtype": "i64"}, {})],
    "rms_norm": [([F, tt((8,))], {"eps": 1e-5}, {}), ([tt(("T", 8), "bf16")], {"eps": 1e-6}, {})],
    "l2norm": [([F], {}, {})],
    "causal_conv1d": [([F, tt((8, 1, 4)), tt(("B", 8, 4))], {}, {})],
    "kda_recurrence": [([tt(("B", "T", 2, 4))] * 3 + [tt(("B", "T", 2, 4)), tt(("B", "T", 2)),
                                                      tt(("B", 2, 4, 4))], {}, {})],
    "kda_fused": [([tt(("B", "T", 8))] * 4 + [tt(("B", "T", 2)), tt(("B", "T", 8))] + [tt((8, 1, 4))] * 3
                   + [tt((3,)), tt((8,)), tt((4,)), tt(("B", 2, 4, 4)), tt(("B", 24, 4))],
                   {"heads": 2, "head_dim": 4}, {})],
    "mla_attention": [([tt(("B", "T", 2, 4)), tt(("B", "L+T", 2, 4)), tt(("B", "L+T", 2, 3))],
                       {"scale": 0.5}, {}),
                      ([tt(("B", "T", 2, 6)), tt(("B", "L+T", 6))], {"absorbed": True, "v_dim": 4, "scale": 0.3},
                       {})],
    "dsa_index_topk": [([tt(("B", "T", 3, 4)), tt(("B", "T", 3)), tt(("B", "L+T", 4))], {"topk": 4}, {}),
                       ([tt(("B", "T", 3, 4)), tt(("B", "T", 3)), tt(("B", "L+T", 4), "f8e4m3"), tt(("B", "L+T"))],
                        {"topk": 4}, {}),
                       ([tt(("B", "T", 3, 4)), tt(("B", "T", 3)), tt(("B", "L+T", 4), "f8e4m3"), tt(("B", "L+T")),
                         tt(("B", "L+T", 2), "u8")], {"topk": 2, "rerank": 1}, {4: 256})],
    "fp8_quantize": [([F], {}, {}), ([tt(("B", "T", 8), "bf16")], {}, {})],
    "fp8_split": [([F], {}, {}), ([tt(("B", "T", 8), "bf16")], {}, {})],
    "attn_res_inter": [([tt((3, 8)), F, F], {"eps": 1e-6}, {})],
    "attn_res_merge": [([tt((3, "B", "T", 8)), tt((3, "B", "T")), F, tt((3, 8))], {"index": 1, "eps": 1e-6}, {})],
    "cache_append": [([tt(("B", "L", 8)), tt(("B", "T", 8))], {}, {})],
    "moe_route": [([tt(("N", 6)), tt((6,))], {"top_k": 2, "scaling": 2.5}, {})],
    "moe_experts": [([tt(("N", 8)), tt(("N", 2)), tt(("N", 2), I64), tt((3, 5, 8)), tt((3, 5, 8)), tt((3, 8, 5))],
                     {}, {2: 3})],
    "einsum": [([tt(("B", "T", 2, 4)), tt(("B", "S", 2, 4))], {"equation": "bthd,bshd->bhts"}, {})],
    "layer_norm": [([F, tt((8,)), tt((8,))], {"eps": 1e-6}, {}), ([F], {}, {})],
    "all_reduce": [([F], {}, {})],
    "reduce_scatter": [([F], {"dim": 2}, {})],
    "all_gather": [([F], {"dim": 1}, {})],
    "reduce_scatter_tokens": [([F], {}, {})],
    "shard_tokens": [([F], {}, {})],
    "all_gather_tokens": [([tt((1, "B*T", 8))], {"shape": ["B", "T", 8]}, {})],
}


def make_tensor(t: TensorType, high: int | None, gen):
    shape = t.concrete_shape(BIND)
    if t.dtype in FLOAT_DTYPES:
        x = torch.rand(shape, generator=gen) + 0.1  # positive: log/sqrt/rsqrt stay finite
        return x.to(torch_dtype(t.dtype))
    if t.dtype == "bool":
        return torch.rand(shape, generator=gen) < 0.5
    return torch.randint(0, high or 3, shape, generator=gen).to(torch_dtype(t.dtype))


def test_every_registered_op_has_a_case():
    missing = set(all_ops()) - set(CASES)
    assert not missing, f"ops without an infer/ref case: {sorted(missing)}"


@pytest.mark.parametrize("name,case", [(n, i) for n in sorted(CASES) for i in range(len(CASES[n]))])
def test_ref_matches_infer(name, case):
    types, attrs, highs = CASES[name][case]
    opdef = get_op(name)
    attrs = opdef.normalize_attrs(attrs)
    outs = opdef.infer(attrs, types)
    gen = torch.Generator().manual_seed(case)
    tensors = [make_tensor(t, highs.get(i), gen) for i, t in enumerate(types)]
    got = opdef.ref(opdef.concrete_attrs(attrs, BIND), *tensors)
    assert len(got) == len(outs)
    for t, x in zip(outs, got):
        assert tuple(x.shape) == t.concrete_shape(BIND), (name, t, x.shape)
        assert x.dtype == torch_dtype(t.dtype), (name, t, x.dtype)
    flops, nbytes = opdef.cost(attrs, types, outs)
    from k3c.ir.types import evaluate

    assert evaluate(flops, BIND) >= 0 and evaluate(nbytes, BIND) >= 0


def test_get_op_unknown_names_the_op():
    with pytest.raises(UnsupportedError, match="frobnicate"):
        get_op("frobnicate")


def test_bad_attrs_and_types_raise():
    with pytest.raises(IRError, match="unknown attr"):
        get_op("softmax").normalize_attrs({"axis": 1})
    with pytest.raises(IRError, match="missing required attr"):
        get_op("cast").normalize_attrs({})
    with pytest.raises(IRError, match="insert a cast"):
        get_op("add").infer({"scalar": None, "reverse": False}, [tt((2,)), tt((2,), "bf16")])
    with pytest.raises(IRError, match="broadcast"):
        get_op("add").infer({"scalar": None, "reverse": False}, [tt(("T",)), tt(("B",))])


dims = st.integers(1, 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(dims, min_size=0, max_size=4), st.lists(dims, min_size=0, max_size=4), st.data())
def test_broadcast_infer_matches_torch(a, b, data):
    # knock out some dims to 1 so that shapes broadcast; compare with torch's own broadcasting
    b = [1 if data.draw(st.booleans()) else x for x in b]
    n = min(len(a), len(b))
    for i in range(1, n + 1):
        if a[-i] != b[-i] and a[-i] != 1 and b[-i] != 1:
            b[-i] = 1
    opdef = get_op("mul")
    attrs = opdef.normalize_attrs({})
    (out,) = opdef.infer(attrs, [tt(a), tt(b)])
    (r,) = opdef.ref(attrs, torch.rand(a), torch.rand(b))
    assert tuple(out.shape) == tuple(r.shape) == torch.broadcast_shapes(tuple(a), tuple(b))


@settings(max_examples=60, deadline=None)
@given(st.lists(dims, min_size=1, max_size=4), st.data())
def test_reshape_infer_matches_torch(shape, data):
    total = math.prod(shape)
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    first = data.draw(st.sampled_from(divisors))
    target = [first, -1] if data.draw(st.booleans()) else [first, total // first]
    opdef = get_op("reshape")
    attrs = opdef.normalize_attrs({"shape": target})
    (out,) = opdef.infer(attrs, [tt(shape)])
    (r,) = opdef.ref(attrs, torch.rand(shape))
    assert tuple(out.shape) == tuple(r.shape)


def test_symbolic_reshape_and_cat_simplify():
    opdef = get_op("reshape")
    (out,) = opdef.infer(opdef.normalize_attrs({"shape": ["B", "T", 2, -1]}), [tt(("B", "T", 96))])
    assert out == tt(("B", "T", 2, 48))
    (c,) = get_op("cat").infer({"dim": 1}, [tt(("B", "L", 8)), tt(("B", "T", 8))])
    assert c == tt(("B", "T+L", 8))
    with pytest.raises(IRError):
        opdef.infer(opdef.normalize_attrs({"shape": ["B", 5]}), [tt(("B", "T"))])
