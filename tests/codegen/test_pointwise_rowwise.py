"""Generated pointwise / rowwise Triton kernels (k3c.codegen.triton) under the Triton interpreter, fp32.

Every kernel is emitted, written to a file, imported and launched; its outputs must match the IR reference
(each node's `ref`, node by node) on random inputs: max |got - want| / max |want| <= 1e-5 for floats (NaN and
inf in the same places), exact for ints and bools. Hand-built groups cover broadcasting (rank 0 to 5), scalar and
reversed operands, casts, where / masked_fill, every unary op and non-power-of-2 rows; then every pointwise and
rowwise group that form_kernels makes of k3-tiny and kimi-linear-tiny (prefill and decode).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors need the interpreter; set before triton.jit runs

import ast
import importlib.util

import pytest
import torch

from k3c.codegen.triton import emit
from k3c.errors import UnsupportedError
from k3c.ir import Graph, TensorType
from k3c.ir.kernels import KernelGroup
from k3c.ir.kernels import kernel_groups
from k3c.ir.ops import get_op
from k3c.ir.types import torch_dtype
from k3c.passes.form_kernels import form_kernels
from test_form_kernels import CTX, PRESETS, formed

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"  # TRITON_INTERPRET=0 runs the same tests on a GPU
pytestmark = [
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                       reason="the kernels run under TRITON_INTERPRET=1 on CPU, or on a CUDA GPU"),
    # numpy warns when the interpreter evaluates both sides of a tl.where or masked-off lanes (log(0), x / 0)
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

TOL = 1e-5
BINDS = {"B": 2, "T": 3, "L": 4, "N": 4, "S": 8}
ALLOWED_IMPORTS = {"torch", "triton", "triton.language", "math"}


# ---- helpers ------------------------------------------------------------------------------------------------------
def load(src: str, path) -> object:
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make(v, gen, binds):
    shape, dt = v.type.concrete_shape(binds), v.type.dtype
    if dt == "bool":
        return torch.rand(shape, generator=gen) < 0.5
    if dt in ("i64", "i32", "u8"):
        return torch.randint(-20 if dt != "u8" else 0, 20, shape, generator=gen).to(torch_dtype(dt))
    return torch.randn(shape, generator=gen).to(torch_dtype(dt))


def reference(group: KernelGroup, tensors: list, binds) -> dict:
    env = dict(zip(group.inputs, tensors))
    for n in group.nodes:
        opdef = get_op(n.op)
        env.update(zip(n.outputs, opdef.ref(opdef.concrete_attrs(n.attrs, binds), *[env[v] for v in n.inputs])))
    return env


def assert_match(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if not want.dtype.is_floating_point:
        assert torch.equal(got, want), f"{what}: {int((got != want).sum())} elements differ"
        return
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()), f"{what}: NaN in different places"
    inf = w.isinf()
    assert torch.equal(g[inf], w[inf]), f"{what}: inf differ"
    fin = w.isfinite()
    scale = w[fin].abs().max().item() if fin.any() else 1.0
    err = (g[fin] - w[fin]).abs().max().item() / max(scale, 1e-30) if fin.any() else 0.0
    assert err <= tol, f"{what}: max rel err {err:.3g} > {tol}"


def run_group(group: KernelGroup, tmp_path, *, binds=BINDS, seed=0, inputs=None, tol=TOL) -> str:
    """Emit `group`, check the source, launch it on random inputs (`inputs`: value -> tensor overrides) and
    compare with the reference; returns the source."""
    src = emit(group)
    assert emit(group) == src, "emitted source is not deterministic"
    tree = ast.parse(src)
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= ALLOWED_IMPORTS, imported
    for n in group.nodes:
        assert f"%{n.outputs[0].name} = {n.op}(" in src  # the header lists the IR lines
    mod = load(src, tmp_path / f"{group.name}.py")
    assert mod.NAME == group.name and mod.IR_NODES == group.ir_nodes
    gen = torch.Generator().manual_seed(seed)
    ins = [(inputs or {}).get(v, None) for v in group.inputs]
    ins = [t if t is not None else make(v, gen, binds) for v, t in zip(group.inputs, ins)]
    outs = [torch.full(v.type.concrete_shape(binds), 7, dtype=torch_dtype(v.type.dtype), device=DEVICE)
            for v in group.outputs]
    mod.launch([t.to(DEVICE) for t in ins], outs, binds)
    outs = [t.cpu() for t in outs]
    want = reference(group, ins, binds)
    for v, t in zip(group.outputs, outs):
        assert_match(t, want[v], f"{group.name} %{v.name}", tol)
    return src


def one_group(g: Graph, kind: str) -> KernelGroup:
    """The single triton group form_kernels makes of `g` (asserting there is exactly one, of `kind`)."""
    (group,) = [k for k in kernel_groups(form_kernels(g, CTX)) if k.backend == "triton"]
    assert group.kind == kind and len(group.nodes) == len(g.nodes), [n.op for n in group.nodes]
    return group


def whole(g: Graph, kind: str) -> KernelGroup:
    """All of `g` as one group, built by hand (for groups form_kernels would not make)."""
    defined = {v for n in g.nodes for v in n.outputs}
    ins = list(dict.fromkeys(v for n in g.nodes for v in n.inputs if v not in defined))
    return KernelGroup(f"k9000_{kind}", "triton", kind, list(g.nodes), ins, list(g.outputs.values()))


def graph(**inputs) -> tuple[Graph, list]:
    g = Graph()
    return g, [g.add_input(k, TensorType(shape, dt)) for k, (shape, dt) in inputs.items()]


# ---- pointwise, hand-built ----------------------------------------------------------------------------------------
def test_broadcasting_where_masked_fill(tmp_path):
    g, (x, w, m, s, r) = graph(x=(("B", "T", 7), "f32"), w=((7,), "f32"), m=(("B", 1, 7), "bool"),
                               s=((1,), "f32"), r=((), "f32"))
    a = g.add("mul", x, w)
    b = g.add("add", a, s)
    c = g.add("masked_fill", b, m, value=-3.5)
    d = g.add("where", m, c, r)
    e = g.add("masked_fill", d, m, value=float("-inf"))
    g.set_output("c", c), g.set_output("e", e)
    src = run_group(one_group(g, "pointwise"), tmp_path)
    assert "w_stride2" in src and "x_stride0" not in src  # only the broadcast inputs index through strides


def test_rank5_broadcast_and_smaller_intermediate(tmp_path):
    g, (x, y, v) = graph(x=((2, 3, 1, 2, 4), "f32"), y=((3, 1, 4), "f32"), v=((4,), "f32"))
    a = g.add("mul", v, scalar=2.0)             # [4], broadcast inside the group
    b = g.add("sub", x, y)                      # [2,3,3,2,4]
    c = g.add("add", b, a)
    g.set_output("c", c)
    run_group(whole(g, "pointwise"), tmp_path)


@pytest.mark.parametrize("reverse", [False, True])
def test_scalar_operands(tmp_path, reverse):
    g, (x,) = graph(x=(("B", 5), "f32"))
    h = x
    for op, s in (("add", 1.5), ("sub", -2.0), ("mul", 3.0), ("div", 4.0), ("maximum", -0.25), ("minimum", 0.5)):
        h = g.add(op, h, scalar=s, reverse=reverse)
    c = g.add("gt", x, scalar=0.3, reverse=reverse)
    g.set_output("h", h), g.set_output("c", c)
    run_group(one_group(g, "pointwise"), tmp_path, seed=int(reverse))


def test_comparisons_and_logic(tmp_path):
    g, (x, y, p) = graph(x=(("B", 6), "f32"), y=((6,), "f32"), p=(("B", 6), "bool"))
    outs = [g.add(op, x, y) for op in ("eq", "ne", "lt", "le", "gt", "ge")]
    q = g.add("logical_and", outs[2], p)
    q = g.add("logical_or", q, outs[5])
    q = g.add("logical_xor", q, p)
    q = g.add("logical_not", q)
    z = g.add("eq", x, x)
    mx = g.add("maximum", x, y)
    g.set_output("q", q), g.set_output("z", z), g.set_output("lt", outs[2]), g.set_output("mx", mx)
    run_group(one_group(g, "pointwise"), tmp_path)


def test_casts_and_integer_arithmetic(tmp_path):
    g, (x, i, j, p) = graph(x=(("B", 9), "f32"), i=(("B", 9), "i64"), j=(("B", 9), "i32"), p=(("B", 9), "bool"))
    big = g.add("mul", x, scalar=10.0)
    to_int = g.add("cast", big, to="i64")       # truncation toward zero
    to_bool = g.add("cast", to_int, to="bool")
    from_bool = g.add("cast", p, to="f32")
    ji = g.add("cast", j, to="i64")
    k = g.add("add", i, ji)
    k = g.add("mul", k, scalar=3.0)
    q = g.add("div", k, i)                      # int / int: true division, truncated back to i64
    f = g.add("mul", i, scalar=2.5)             # int x fractional scalar: f32 product truncated back to i64
    r = g.add("cast", k, to="f32")
    n = g.add("neg", i)
    a = g.add("abs", n)
    u = g.add("relu", n)
    for name, v in dict(to_int=to_int, to_bool=to_bool, from_bool=from_bool, q=q, f=f, r=r, a=a, u=u).items():
        g.set_output(name, v)
    i_nonzero = make(i, torch.Generator().manual_seed(3), BINDS)
    i_nonzero[i_nonzero == 0] = 5
    run_group(one_group(g, "pointwise"), tmp_path, inputs={i: i_nonzero})


def test_cast_to_bf16_rounds(tmp_path):
    # The interpreter converts f32 -> bf16 by truncation where GPUs round to nearest even: allow 1 bf16 ulp there.
    g, (x,) = graph(x=(("B", 16), "f32"))
    b = g.add("cast", x, to="bf16")
    y = g.add("cast", b, to="f32")
    g.set_output("b", b), g.set_output("y", y)
    run_group(one_group(g, "pointwise"), tmp_path, tol=2.0 ** -7 if INTERPRET else TOL)


UNARY = [("exp", {}), ("sigmoid", {}), ("tanh", {}), ("silu", {}), ("neg", {}), ("abs", {}), ("relu", {}),
         ("softplus", {}), ("softplus", {"beta": 2.0, "threshold": 5.0}), ("gelu", {}),
         ("gelu", {"approximate": "tanh"}), ("clamp", {"min": -0.5, "max": 0.75}), ("clamp", {"min": 0.1}),
         ("pow", {"exponent": 2.0}), ("pow", {"exponent": 3.0}), ("pow", {"exponent": -1.0}),
         ("pow", {"exponent": 5.0}), ("pow", {"exponent": 0.0})]
POSITIVE = [("log", {}), ("sqrt", {}), ("rsqrt", {}), ("reciprocal", {}), ("pow", {"exponent": 0.5}),
            ("pow", {"exponent": -0.5}), ("pow", {"exponent": 1.5})]


def test_unary_ops(tmp_path):
    g, (x, p) = graph(x=((4, 50), "f32"), p=((4, 50), "f32"))
    for i, (op, attrs) in enumerate(UNARY):
        g.set_output(f"u{i}", g.add(op, x, **attrs))
    for i, (op, attrs) in enumerate(POSITIVE):
        g.set_output(f"p{i}", g.add(op, p, **attrs))
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(4, 50, generator=gen) * 4
    xs[0, :20] = torch.linspace(-0.3, 0.3, 20)  # tanh's small-|x| branch and its edge
    xs[1, :4] = torch.tensor([30.0, -30.0, 1e-4, -1e-4])
    ps = torch.rand(4, 50, generator=gen) * 5 + 0.05
    group = one_group(g, "pointwise")
    for v in group.outputs:  # compare each op on its own scale
        run_group(KernelGroup(group.name + "_" + v.name, "triton", "pointwise",
                              [n for n in group.nodes if n.outputs[0] is v],
                              [g.producer(v).inputs[0]], [v]), tmp_path, inputs={x: xs, p: ps})


# ---- rowwise, hand-built ------------------------------------------------------------------------------------------
ROWS = [("rms_norm", 1, {"eps": 1e-6}), ("rms_norm", 0, {"eps": 1e-5}), ("layer_norm", 0, {}),
        ("layer_norm", 1, {"eps": 1e-6}), ("layer_norm", 2, {}), ("l2norm", 0, {}), ("softmax", 0, {}),
        ("sum", 0, {"dims": [-1]}), ("mean", 0, {"dims": [2], "keepdim": True}), ("amax", 0, {"dims": [-1]}),
        ("amin", 0, {"dims": [-1], "keepdim": True})]


@pytest.mark.parametrize("D", [1, 7, 33, 64, 100])
@pytest.mark.parametrize("op,n_params,attrs", ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_row_ops(tmp_path, op, n_params, attrs, D):
    g, ins = graph(x=(("B", "T", D), "f32"), w=((D,), "f32"), b=((D,), "f32"))
    y = g.add(op, *ins[:1 + n_params], **attrs)
    g.set_output("y", y)
    run_group(one_group(g, "rowwise"), tmp_path, seed=D)


def test_softmax_with_masked_scores_and_rank1_reduction(tmp_path):
    g, (x, m) = graph(x=(("B", 12), "f32"), m=(("B", 12), "bool"))
    s = g.add("masked_fill", x, m, value=float("-inf"))
    g.set_output("p", g.add("softmax", s))
    g2, (v,) = graph(v=((37,), "f32"))
    g2.set_output("s", g2.add("sum", v))        # dims=None on rank 1: the last dim; rank-0 output
    ins = [torch.randn(2, 12), torch.rand(2, 12) < 0.5]
    ins[1][:, 0] = False                         # keep one score per row
    groups = [k for k in kernel_groups(form_kernels(g, CTX)) if k.backend == "triton"]
    assert [k.kind for k in groups] == ["pointwise", "rowwise"]
    pw, rw = groups
    masked = reference(pw, [dict(zip((x, m), ins))[v] for v in pw.inputs], BINDS)[s]
    run_group(rw, tmp_path, inputs={s: masked})
    run_group(one_group(g2, "rowwise"), tmp_path)


def test_rowwise_epilogues(tmp_path):
    g, (x, w, s, r) = graph(x=(("B", "T", 48), "f32"), w=((48,), "f32"), s=((48,), "f32"), r=(("B", "T", 48), "f32"))
    h = g.add("rms_norm", x, w, eps=1e-6)
    a = g.add("mul", h, s)                        # broadcast vector
    b = g.add("add", a, r)                        # residual
    c = g.add("silu", b)
    g.set_output("h", h), g.set_output("c", c)  # the norm is also an output
    src = run_group(one_group(g, "rowwise"), tmp_path)
    assert "s_stride2" in src
    g2, (x2, v) = graph(x=(("B", "T", 20), "f32"), v=(("T",), "f32"))
    m = g2.add("mean", x2, dims=[-1])             # [B, T]
    e = g2.add("mul", m, v)                       # broadcast over B, at one scalar offset per program
    e = g2.add("rsqrt", g2.add("add", g2.add("abs", e), scalar=1e-3))
    g2.set_output("e", e)
    run_group(one_group(g2, "rowwise"), tmp_path)


# ---- strided inputs (TAKES_VIEWS): column slices are read in place, other layouts through a copy ----------------
def column_slice(shape, extra=5, seed=0) -> torch.Tensor:
    """A [..., n] view of columns 2..2+n of a random [..., n + extra] buffer: rows `n + extra` elements apart."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(*shape[:-1], shape[-1] + extra, generator=g)
    return wide[..., 2:2 + shape[-1]]


def test_pointwise_reads_views(tmp_path):
    g, (x, y, w) = graph(x=(("B", "T", 7), "f32"), y=(("B", "T", 7), "f32"), w=((7,), "f32"))
    g.set_output("c", g.add("mul", g.add("add", x, y), w))
    group = one_group(g, "pointwise")
    B, T = BINDS["B"], BINDS["T"]
    xs, ws = column_slice((B, T, 7)), torch.randn(14)[::2]   # a row-strided view; a strided broadcast input
    assert not xs.is_contiguous() and not ws.is_contiguous()
    src = run_group(group, tmp_path, inputs={x: xs, w: ws})
    assert "TAKES_VIEWS = True" in src and "x, x_rs = _row_view(x)" in src
    yt = torch.randn(T, B, 7).transpose(0, 1)                 # rows do not collapse to one stride: copied
    run_group(group, tmp_path, inputs={x: xs, y: yt, w: ws})
    mod = load(src, tmp_path / "again.py")
    assert mod._row_view(xs)[1] == 12 and mod._row_view(yt)[0].is_contiguous()


def test_rowwise_reads_views(tmp_path):
    g, (x, w, r) = graph(x=(("B", "T", 20), "f32"), w=((20,), "f32"), r=(("B", "T", 20), "f32"))
    g.set_output("c", g.add("add", g.add("rms_norm", x, w, eps=1e-6), r))
    B, T = BINDS["B"], BINDS["T"]
    src = run_group(one_group(g, "rowwise"), tmp_path,
                    inputs={x: column_slice((B, T, 20)), r: column_slice((B, T, 20), extra=3, seed=1)})
    assert "row * x_rs + cols" in src and "r, r_rs = _row_view(r)" in src


# ---- errors -------------------------------------------------------------------------------------------------------
def test_errors():
    g, (x, w) = graph(x=(("B", 4), "f32"), w=((4, 4), "f32"))
    lin = g.add("linear", x, w)
    g.set_output("y", lin)
    with pytest.raises(UnsupportedError, match="no triton emitter for kernel kind 'frobnicate'"):
        emit(KernelGroup("k0000_frobnicate", "triton", "frobnicate", list(g.nodes), [x, w], [lin]))
    with pytest.raises(UnsupportedError, match="not an elementwise op"):
        emit(KernelGroup("k0000_pointwise", "triton", "pointwise", list(g.nodes), [x, w], [lin]))
    with pytest.raises(UnsupportedError, match="backend 'library'"):
        emit(KernelGroup("k0000_linear", "library", "linear", list(g.nodes), [x, w], [lin]))
    g6, (a, b) = graph(a=((2, 1, 2, 1, 2, 1), "f32"), b=((2, 1, 2, 1, 2, 2), "f32"))
    g6.set_output("c", g6.add("add", a, b))
    with pytest.raises(UnsupportedError, match="at most 5 dims"):
        emit(whole(g6, "pointwise"))
    gs, (x2,) = graph(x=(("B", 4), "f32"))
    gs.set_output("s", gs.add("softmax", x2, dim=0))
    with pytest.raises(UnsupportedError, match="only over the last dim"):
        emit(whole(gs, "rowwise"))


# ---- every pointwise / rowwise group of the tiny presets -----------------------------------------------------------
@pytest.mark.parametrize("model,mode", PRESETS)
def test_tiny_preset_groups(tmp_path, model, mode):
    kinds = {"pointwise", "rowwise"} | ({"attn_res_row"} if model.startswith("k3") else set())
    groups = [k for k in kernel_groups(formed(model, mode)) if k.kind in kinds]
    assert {k.kind for k in groups} == kinds
    for i, k in enumerate(groups):
        run_group(k, tmp_path, seed=i)
