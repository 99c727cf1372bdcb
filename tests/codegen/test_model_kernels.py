"""Generated model-op kernel modules (mla_attention, dsa_index_topk, attn_res_*, moe_*, kda_fused) against the ops'
`ref` functions, on CPU under TRITON_INTERPRET=1, fp32, small shapes.

Each case builds a one-node `KernelGroup` from a small IR graph, emits its module, writes it to a file, imports
it and calls `launch(inputs, outputs, sizes)` with NaN-filled outputs (so every output element must be written).
Floats must match with max|got − want| / max|want| ≤ 1e-5; integer outputs exactly. The last tests do the same
for every such node of k3.1-pro-tiny and kimi-linear-tiny after the cleanup and model phases, fed with the
values the reference interpreter computes from random inputs.
"""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors need the interpreter; set before triton.jit runs

import pytest
import torch

from k3c.codegen.triton import attention, attn_res, dsa_index, emit, kda_abi, moe
from k3c.frontend import import_model
from k3c.ir.graph import Graph
from k3c.ir.interp import interpret
from k3c.ir.kernels import KernelGroup
from k3c.ir.ops import get_op
from k3c.ir.types import TensorType, torch_dtype
from k3c.passes.pipeline import random_inputs, run_pipeline

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tests run the kernels under TRITON_INTERPRET=1")

RTOL = 1e-5
MODEL_OPS = ("mla_attention", "dsa_index_topk", "attn_res_inter", "attn_res_merge", "moe_route", "moe_experts",
             "kda_fused")


# ---- harness ---------------------------------------------------------------------------------------------------
def one_node_group(op, inputs, attrs):
    """A KernelGroup of one `op` node over graph inputs of the given (shape, dtype) list."""
    g = Graph()
    vals = [g.add_input(f"in{i}", TensorType(shape, dtype)) for i, (shape, dtype) in enumerate(inputs)]
    outs = g.add_node(op, vals, attrs, name_hint=op.replace("_", "."))
    return KernelGroup(f"k0001_{op}", "triton", op, [g.nodes[0]], vals, outs)


def load(source, path, name):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def undefined_globals(module):
    """The global names some function of `module` (plain, Triton or Gluon jit, and the functions nested in them)
    loads that neither the module nor builtins define: a helper the emitter forgot to paste, which would fail only
    where that code path runs (e.g. on a GPU)."""
    import builtins
    import dis
    import types

    names, seen = set(), set()

    def scan(code):
        if code in seen:
            return
        seen.add(code)
        names.update(i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL")
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                scan(c)
    for obj in vars(module).values():
        fn = getattr(obj, "fn", obj)
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
            scan(fn.__code__)
    return sorted(n for n in names if n not in vars(module) and not hasattr(builtins, n))


def check(got, want, what):
    if want.dtype.is_floating_point:
        assert got.dtype == want.dtype, what
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
        assert err <= RTOL, f"{what}: max rel error {err:.3g}"
    else:
        assert torch.equal(got, want), f"{what}:\n{got}\n!=\n{want}"


def run_group(group, tensors, sizes, tmp_path, *, inplace=(), emitter=None, setup=None, as_set=False):
    """Emit + launch `group` on `tensors` (node input order), compare every output with the op's ref.

    inplace: (output index, input index) pairs whose output is the input tensor itself (persistent state).
    setup(module): tweak module constants before launching. as_set: compare integer outputs row by row as sorted
    sets (an op whose contract leaves the order open, `dsa_index_topk`). Returns the module.
    """
    node = group.nodes[0]
    opdef = get_op(node.op)
    attrs = opdef.concrete_attrs(node.attrs, sizes)
    want = opdef.ref(attrs, *[t.clone() for t in tensors])
    src = (emitter or emit)(group)
    assert src == (emitter or emit)(group), "emitter output must be deterministic"
    assert "k3c" not in "".join(ln for ln in src.splitlines() if ln.startswith(("import ", "from ")))
    module = load(src, tmp_path / f"{group.name}.py", f"gen_{group.name}_{id(group)}")
    assert module.NAME == group.name and module.IR_NODES == group.ir_nodes
    missing = undefined_globals(module)
    assert not missing, f"{group.name}: names the module does not define: {missing}"
    if setup is not None:
        setup(module)
    ins = [t.clone(memory_format=torch.contiguous_format) for t in tensors]   # the ABI passes contiguous tensors
    outs = []
    for i, v in enumerate(node.outputs):
        alias = dict(inplace).get(i)
        if alias is not None:
            outs.append(ins[alias])
            continue
        dt = torch_dtype(v.type.dtype)
        fill = float("nan") if dt.is_floating_point else 12345
        outs.append(torch.full(v.type.concrete_shape(sizes), fill, dtype=dt))
    module.launch(ins, outs, sizes)
    for i, (got, ref) in enumerate(zip(outs, want)):
        if as_set:
            got, ref = got.sort(-1).values, ref.sort(-1).values
        check(got, ref, f"{group.name} output {i}")
    return module


def rand(*shape, s=1.0, gen):
    return torch.randn(*shape, generator=gen) * s


def random_idx(B, T, S, topk, gen):
    """idx [B,T,topk]: for each token a random subset of its visible keys in random order, −1 padded."""
    idx = torch.full((B, T, topk), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            vis = S - T + t + 1
            pick = torch.randperm(vis, generator=gen)[:topk]
            idx[b, t, :len(pick)] = pick
            idx[b, t] = idx[b, t, torch.randperm(topk, generator=gen)]
    return idx


# ---- mla_attention ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,L", [(1, 0), (1, 7), (5, 0), (5, 7)])
def test_mla_absorbed(T, L, tmp_path):
    gen = torch.Generator().manual_seed(T * 10 + L)
    B, H, D, DV = 2, 4, 40, 32
    S = L + T
    group = one_node_group("mla_attention", [((B, T, H, D), "f32"), ((B, S, D), "f32")],
                           {"absorbed": True, "scale": D ** -0.5, "v_dim": DV})
    run_group(group, [rand(B, T, H, D, gen=gen), rand(B, S, D, gen=gen)], {}, tmp_path,
              emitter=attention.emit_mla_attention)


@pytest.mark.parametrize("absorbed", [True, False])
def test_mla_reads_cache_views(absorbed, tmp_path):
    """k / v as views of a longer cache pool (a prefix of its positions: rows a pool length apart) give the same
    output as contiguous copies, without the launcher copying them (`TAKES_VIEWS`)."""
    gen = torch.Generator().manual_seed(11)
    B, T, H, D, DV, S, POOL = 2, 3, 4, 24, 16, 9, 20
    kv = [((B, S, D), "f32")] if absorbed else [((B, S, H, D), "f32"), ((B, S, H, DV), "f32")]
    group = one_node_group("mla_attention", [((B, T, H, D), "f32")] + kv,
                           {"absorbed": absorbed, "scale": D ** -0.5, "v_dim": DV, "causal": True})
    mod = run_group(group, [rand(B, T, H, D, gen=gen)] + [rand(*shape, gen=gen) for shape, _ in kv], {}, tmp_path,
                    emitter=attention.emit_mla_attention)
    assert mod.TAKES_VIEWS
    q = rand(B, T, H, D, gen=gen)
    pools = [rand(B, POOL, *shape[2:], gen=gen) for shape, _ in kv]
    views = [p[:, :S] for p in pools]
    assert not any(v.is_contiguous() for v in views)
    got, want = torch.full((B, T, H, DV), float("nan")), torch.full((B, T, H, DV), float("nan"))
    mod.launch([q] + views, [got], {})
    mod.launch([q] + [v.contiguous() for v in views], [want], {})
    assert torch.equal(got, want)


@pytest.mark.parametrize("T,L", [(5, 0), (5, 7), (1, 3)])
def test_mla_unabsorbed(T, L, tmp_path):
    gen = torch.Generator().manual_seed(T + L)
    B, H, D, DV = 2, 3, 24, 16
    S = L + T
    group = one_node_group("mla_attention", [((B, T, H, D), "f32"), ((B, S, H, D), "f32"), ((B, S, H, DV), "f32")],
                           {"scale": 0.3})
    run_group(group, [rand(B, T, H, D, gen=gen), rand(B, S, H, D, gen=gen), rand(B, S, H, DV, gen=gen)], {},
              tmp_path)


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("T,L,guard", [(5, 7, None), (5, 7, 4), (1, 9, 4), (2, 1, None), (3, 1, 4)])
def test_mla_index(absorbed, T, L, guard, tmp_path):
    """topk 4 with S > 4 (idx used, −1 padding in the early rows) and S ≤ 4 (all visible keys or dense guard)."""
    gen = torch.Generator().manual_seed(T * 100 + L)
    B, H, D, DV, topk = 2, 4, 24, 16, 4
    S = L + T
    idx = random_idx(B, T, S, topk, gen)
    if guard is not None and S <= guard:
        idx = torch.where(idx >= 0, (idx + 1) % S, idx)          # not the dense set: the guard must ignore it
    attrs = {"scale": 0.25, "dense_max_keys": guard}
    q = rand(B, T, H, D, gen=gen)
    if absorbed:
        group = one_node_group("mla_attention", [((B, T, H, D), "f32"), ((B, S, D), "f32"), ((B, T, topk), "i64")],
                               {**attrs, "absorbed": True, "v_dim": DV})
        tensors = [q, rand(B, S, D, gen=gen), idx]
    else:
        group = one_node_group("mla_attention", [((B, T, H, D), "f32"), ((B, S, H, D), "f32"),
                                                 ((B, S, H, DV), "f32"), ((B, T, topk), "i64")], attrs)
        tensors = [q, rand(B, S, H, D, gen=gen), rand(B, S, H, DV, gen=gen), idx]
    run_group(group, tensors, {}, tmp_path)


@pytest.mark.parametrize("T,topk", [(1, None), (2, None), (1, 24)])
def test_mla_split_keys(T, topk, tmp_path):
    """Flash-decoding split-K path (forced by module constants) with and without idx."""
    gen = torch.Generator().manual_seed(7)
    B, H, D, DV, S = 1, 4, 40, 32, 70
    types, tensors = [((B, T, H, D), "f32"), ((B, S, D), "f32")], [rand(B, T, H, D, gen=gen), rand(B, S, D, gen=gen)]
    if topk:
        types.append(((B, T, topk), "i64"))
        tensors.append(random_idx(B, T, S, topk, gen))
    group = one_node_group("mla_attention", types, {"absorbed": True, "scale": 0.2, "v_dim": DV})

    def force_split(m):
        m.MIN_KEYS_PER_SPLIT, m.TARGET_PROGRAMS = 8, 64

    module = run_group(group, tensors, {}, tmp_path, setup=force_split)
    assert module.MIN_KEYS_PER_SPLIT == 8


# ---- dsa_index_topk --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,L,topk", [(3, 9, 4), (4, 4, 6), (1, 12, 5), (2, 2, 5)])
def test_dsa_index_topk(T, L, topk, tmp_path):
    """Ties (zero and duplicate key rows, a token with all-zero weights, all-negative weights) and L < topk."""
    gen = torch.Generator().manual_seed(L * 7 + T)
    B, J, D = 2, 4, 16
    q, w, k = rand(B, T, J, D, gen=gen), rand(B, T, J, gen=gen), rand(B, L, D, gen=gen)
    k[:, ::3] = 0.0                                 # score exactly 0: ties broken by lowest position
    if L > 4:
        k[:, 4] = k[:, 1]                           # duplicate rows: identical scores
    w[0, 0] = 0.0
    w[1, -1] = -w[1, -1].abs()
    group = one_node_group("dsa_index_topk", [((B, T, J, D), "f32"), ((B, T, J), "f32"), ((B, L, D), "f32")],
                           {"topk": topk})
    run_group(group, [q, w, k], {}, tmp_path, emitter=dsa_index.emit_dsa_index_topk)


@pytest.mark.parametrize("L,topk", [(12, 5), (3, 5), (2500, 64)])
def test_dsa_index_topk_radix_decode(L, topk, tmp_path):
    """Decode through the radix select (RADIX_MIN_KEYS lowered to 1): the reference's set (its order is open),
    zero and duplicate rows tying exactly."""
    gen = torch.Generator().manual_seed(L)
    B, J, D = 2, 4, 16
    q, w, k = rand(B, 1, J, D, gen=gen), rand(B, 1, J, gen=gen).abs(), rand(B, L, D, gen=gen)
    k[:, ::3] = 0.0
    if L > 4:
        k[:, 4] = k[:, 1]
    group = one_node_group("dsa_index_topk", [((B, 1, J, D), "f32"), ((B, 1, J), "f32"), ((B, L, D), "f32")],
                           {"topk": topk})
    run_group(group, [q, w, k], {}, tmp_path, emitter=dsa_index.emit_dsa_index_topk,
              setup=lambda m: setattr(m, "RADIX_MIN_KEYS", 1), as_set=True)


def test_dsa_index_topk_scratch_chunks(tmp_path):
    gen = torch.Generator().manual_seed(3)
    B, T, J, D, L = 2, 5, 4, 16, 9
    group = one_node_group("dsa_index_topk", [((B, T, J, D), "f32"), ((B, T, J), "f32"), ((B, L, D), "f32")],
                           {"topk": 3})
    run_group(group, [rand(B, T, J, D, gen=gen), rand(B, T, J, gen=gen), rand(B, L, D, gen=gen)], {}, tmp_path,
              setup=lambda m: setattr(m, "SCRATCH_BYTES", 2 * 8 * B * L))   # 2 token rows per pass: 2 + 2 + 1


# ---- attn_res --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_attn_res(n_blocks, tmp_path):
    gen = torch.Generator().manual_seed(n_blocks)
    Q, B, T, D = 3, 2, 3, 40
    queries = rand(Q, D, gen=gen)
    blocks = [rand(B, T, D, s=1 + i, gen=gen) for i in range(n_blocks)]
    group = one_node_group("attn_res_inter", [((Q, D), "f32")] + [((B, T, D), "f32")] * n_blocks, {"eps": 1e-5})
    run_group(group, [queries] + blocks, {}, tmp_path, emitter=attn_res.emit_attn_res_inter)
    o, lse = get_op("attn_res_inter").ref({"eps": 1e-5}, queries, *blocks)
    for index in range(Q):
        group = one_node_group("attn_res_merge", [((Q, B, T, D), "f32"), ((Q, B, T), "f32"), ((B, T, D), "f32"),
                                                  ((Q, D), "f32")], {"index": index, "eps": 1e-5})
        run_group(group, [o, lse, rand(B, T, D, gen=gen), queries], {}, tmp_path)


def test_attn_res_inter_split_d(tmp_path):
    """D = 200 cut into 4 ranges of 64 (few rows: the decode path on a GPU)."""
    gen = torch.Generator().manual_seed(5)
    Q, B, T, D = 2, 2, 1, 200
    group = one_node_group("attn_res_inter", [((Q, D), "f32")] + [((B, T, D), "f32")] * 2, {"eps": 1e-5})
    run_group(group, [rand(Q, D, s=0.1, gen=gen), rand(B, T, D, gen=gen), rand(B, T, D, gen=gen)], {}, tmp_path,
              setup=lambda m: setattr(m, "TARGET_PROGRAMS", 64))


def test_attn_res_merge_split_d(tmp_path):
    """D = 200 in blocks of 64: each of 2 rows cut into 4 column ranges, each recomputing the row's logit."""
    gen = torch.Generator().manual_seed(6)
    Q, B, T, D = 2, 2, 1, 200
    o, lse = rand(Q, B, T, D, gen=gen), rand(Q, B, T, gen=gen)
    group = one_node_group("attn_res_merge", [((Q, B, T, D), "f32"), ((Q, B, T), "f32"), ((B, T, D), "f32"),
                                              ((Q, D), "f32")], {"index": 1, "eps": 1e-5})
    run_group(group, [o, lse, rand(B, T, D, gen=gen), rand(Q, D, s=0.1, gen=gen)], {}, tmp_path,
              setup=lambda m: (setattr(m, "TARGET_PROGRAMS", 8), setattr(m, "MERGE_BLOCK_D", 64)))


# ---- moe -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize,scaling", [(True, 2.5), (False, 1.0)])
def test_moe_route_ties(renormalize, scaling, tmp_path):
    gen = torch.Generator().manual_seed(1)
    N, E, k = 6, 8, 3
    logits = rand(N, E, gen=gen)
    logits[0] = 0.25                                # all experts tie: ids 0, 1, 2
    logits[1, 5] = logits[1, 2] = logits[1].max() + 1.0
    bias = torch.zeros(E)
    bias[6] = 0.5
    logits[2, 6], logits[2, 3] = 0.0, 30.0          # s + bias: 0.5 + 0.5 ties sigmoid(30) = 1.0 (fp32)
    group = one_node_group("moe_route", [((N, E), "f32"), ((E,), "f32")],
                           {"top_k": k, "scaling": scaling, "renormalize": renormalize})
    run_group(group, [logits, bias], {}, tmp_path, emitter=moe.emit_moe_route)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts(act, tmp_path):
    gen = torch.Generator().manual_seed(2)
    N, k, E, D, I = 5, 2, 4, 24, 20
    z = rand(N, D, gen=gen)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [1, -1], [0, 3]])       # expert 2 gets no token; one unused slot
    weights = torch.rand(N, k, generator=gen)
    w1, w3, w2 = rand(E, I, D, s=2.0, gen=gen), rand(E, I, D, s=3.0, gen=gen), rand(E, D, I, s=0.3, gen=gen)
    group = one_node_group("moe_experts", [((N, D), "f32"), ((N, k), "f32"), ((N, k), "i64"), ((E, I, D), "f32"),
                                           ((E, I, D), "f32"), ((E, D, I), "f32")], {"act": act})
    run_group(group, [z, weights, ids, w1, w3, w2], {}, tmp_path, emitter=moe.emit_moe_experts)


def test_moe_experts_large_tiles(tmp_path):
    """Many rows per expert: the 64-row tiles, several tiles per expert, and ids as i32."""
    gen = torch.Generator().manual_seed(4)
    N, k, E, D, I = 70, 2, 2, 16, 16
    ids = torch.stack([torch.zeros(N, dtype=torch.int32), torch.ones(N, dtype=torch.int32)], 1)
    group = one_node_group("moe_experts", [((N, D), "f32"), ((N, k), "f32"), ((N, k), "i32"), ((E, I, D), "f32"),
                                           ((E, I, D), "f32"), ((E, D, I), "f32")], {"act": "situ"})
    run_group(group, [rand(N, D, gen=gen), torch.rand(N, k, generator=gen), ids, rand(E, I, D, gen=gen),
                      rand(E, I, D, gen=gen), rand(E, D, I, gen=gen)], {}, tmp_path)


@pytest.mark.parametrize("act,N", [("situ", 5), ("silu", 5), ("situ", 12), ("situ", 32), ("situ", 128)])
def test_moe_experts_mxfp4(act, N, tmp_path):
    """MXFP4 experts (every byte value, scales 2^-3 .. 2^2) decoded in the kernels: equal to the reference's
    dequantize-then-GEMM in fp32; several 32-value groups per row in both GEMMs, masked I tail (I = 96, 32-wide
    K tiles); N = 5: the decode tiles, N = 12 (6 rows per expert): 16-token tiles (these scales need both
    multiplies; with one, the `wgmma` decode kernels' config, which the interpreter's f32 also runs on the Triton
    kernels), N = 32 (16 rows per expert): the large-batch decode tiles (32 rows), N = 128 (64 per expert): the
    prefill tiles (`mx_default_config`)."""
    gen = torch.Generator().manual_seed(5)
    k, E, D, I = 2, 4, 64, 96
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [1, -1], [0, 3]])       # expert 2 gets no token; one unused slot
    if N > len(ids):
        ids = torch.stack([torch.arange(N) % 2, 2 + torch.arange(N) % 2], 1)

    def mx(R, C):
        return (torch.randint(0, 256, (E, R, C // 2), dtype=torch.uint8, generator=gen),
                torch.randint(124, 130, (E, R, C // 32), dtype=torch.uint8, generator=gen))

    (w1, s1), (w3, s3), (w2, s2) = mx(I, D), mx(I, D), mx(D, I)
    types = [((N, D), "f32"), ((N, k), "f32"), ((N, k), "i64"), ((E, I, D // 2), "u8"), ((E, I, D // 2), "u8"),
             ((E, D, I // 2), "u8"), ((E, I, D // 32), "u8"), ((E, I, D // 32), "u8"), ((E, D, I // 32), "u8")]
    group = one_node_group("moe_experts", types, {"act": act, "weight_format": "mxfp4"})
    run_group(group, [rand(N, D, s=0.1, gen=gen), torch.rand(N, k, generator=gen), ids, w1, w3, w2, s1, s3, s2], {},
              tmp_path, emitter=moe.emit_moe_experts)


# ---- kda_fused -------------------------------------------------------------------------------------------------
# the softplus gate never uses the chunk kernel, so T = 17 (chunk path) is run for the bounded gate only
@pytest.mark.parametrize("gate,T", [("lower_bound", 1), ("lower_bound", 5), ("lower_bound", 17),
                                    ("softplus", 1), ("softplus", 5)])
def test_kda_fused(gate, T, tmp_path):
    """Decode (T = 1) and prefill (token loop; T = 17 with the bounded gate: chunk kernel), state in place."""
    gen = torch.Generator().manual_seed(T)
    B, H, K, W = 2, 2, 8, 4
    HK = H * K
    acts = [rand(B, T, HK, gen=gen) for _ in range(4)] + [rand(B, T, H, gen=gen), rand(B, T, HK, gen=gen)]
    weights = [rand(HK, 1, W, s=0.5, gen=gen) for _ in range(3)] + [rand(H, s=0.5, gen=gen),
                                                                      rand(HK, s=0.3, gen=gen),
                                                                      1 + 0.1 * rand(K, gen=gen)]
    state = [rand(B, H, K, K, s=0.1, gen=gen), rand(B, 3 * HK, W, gen=gen)]
    types = [((B, T, HK), "f32")] * 4 + [((B, T, H), "f32"), ((B, T, HK), "f32")] + [((HK, 1, W), "f32")] * 3 + \
        [((H,), "f32"), ((HK,), "f32"), ((K,), "f32"), ((B, H, K, K), "f32"), ((B, 3 * HK, W), "f32")]
    group = one_node_group("kda_fused", types, {"heads": H, "head_dim": K, "gate": gate})
    run_group(group, acts + weights + state, {}, tmp_path, inplace=[(1, 12), (2, 13)],
              emitter=kda_abi.emit_kda_fused)


@pytest.mark.parametrize("T", [1, 17])
def test_kda_fused_row_strided_activations(T, tmp_path):
    """The six activations as column views of one buffer (decode after `fuse_gemms`): the module takes views
    (TAKES_VIEWS) and gives the same outputs, bit for bit, as for contiguous copies."""
    gen = torch.Generator().manual_seed(5)
    B, H, K, W = 2, 2, 8, 4
    HK = H * K
    widths = [HK, HK, HK, HK, H, HK]                                        # q, k, v, f, beta, gate
    fused = rand(B, T, sum(widths) + 5, gen=gen)
    views = list(torch.split(fused, widths + [5], -1))[:6]
    rest = [rand(HK, 1, W, s=0.5, gen=gen) for _ in range(3)] + [rand(H, s=0.5, gen=gen), rand(HK, s=0.3, gen=gen),
                                                                  1 + 0.1 * rand(K, gen=gen)]
    state = [rand(B, H, K, K, s=0.1, gen=gen), rand(B, 3 * HK, W, gen=gen)]
    types = [((B, T, w if w == H else HK), "f32") for w in widths] + [((HK, 1, W), "f32")] * 3 + \
        [((H,), "f32"), ((HK,), "f32"), ((K,), "f32"), ((B, H, K, K), "f32"), ((B, 3 * HK, W), "f32")]
    group = one_node_group("kda_fused", types, {"heads": H, "head_dim": K, "gate": "lower_bound"})
    module = load(kda_abi.emit_kda_fused(group), tmp_path / "kda_strided.py", f"gen_kda_strided_{T}")
    assert module.TAKES_VIEWS is True
    results = []
    for acts in (views, [v.contiguous() for v in views]):
        st = [t.clone() for t in state]
        y = torch.empty(B, T, HK)
        module.launch(acts + rest + st, [y, st[0], st[1]], {})
        results.append([y, *st])
    assert not any(v.is_contiguous() for v in views)
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_kda_fused_two_phase_decode(tmp_path):
    """Decode with the module's two-phase threshold at 0 rows (front-end kernel, then the state kernel; on CPU
    without programmatic dependent launch) matches the one-launch kernel that `test_kda_fused` checks."""
    gen = torch.Generator().manual_seed(11)
    B, H, K, W = 2, 2, 8, 4
    HK = H * K
    acts = [rand(B, 1, HK, gen=gen) for _ in range(4)] + [rand(B, 1, H, gen=gen), rand(B, 1, HK, gen=gen)]
    rest = [rand(HK, 1, W, s=0.5, gen=gen) for _ in range(3)] + [rand(H, s=0.5, gen=gen), rand(HK, s=0.3, gen=gen),
                                                                  1 + 0.1 * rand(K, gen=gen)]
    state = [rand(B, H, K, K, s=0.1, gen=gen), rand(B, 3 * HK, W, gen=gen)]
    types = [((B, 1, HK), "f32")] * 4 + [((B, 1, H), "f32"), ((B, 1, HK), "f32")] + [((HK, 1, W), "f32")] * 3 + \
        [((H,), "f32"), ((HK,), "f32"), ((K,), "f32"), ((B, H, K, K), "f32"), ((B, 3 * HK, W), "f32")]
    group = one_node_group("kda_fused", types, {"heads": H, "head_dim": K, "gate": "lower_bound"})
    module = load(kda_abi.emit_kda_fused(group), tmp_path / "kda_two_phase.py", "gen_kda_two_phase")
    assert module.DECODE_FRONT_MIN_ROWS > B * H                              # the default here: one launch
    results = []
    for min_rows in (module.DECODE_FRONT_MIN_ROWS, 0):
        module.DECODE_FRONT_MIN_ROWS = min_rows
        st = [t.clone() for t in state]
        y = torch.empty(B, 1, HK)
        module.launch(acts + rest + st, [y, st[0], st[1]], {})
        results.append([y, *st])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- every model-op node of the tiny models --------------------------------------------------------------------
@pytest.mark.parametrize("model", ["k3.1-pro-tiny", "kimi-linear-tiny"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_tiny_model_nodes(model, mode, tmp_path):
    sizes = {"B": 2, "T": 3, "L": 4}
    graph, _ = run_pipeline(import_model(model, mode), phases=["cleanup", "model"])
    ins, params = random_inputs(graph, sizes, seed=0)
    seen = []

    def trace(node, args, outs):
        if node.op in MODEL_OPS:
            seen.append((node, [a.clone() for a in args]))

    interpret(graph, ins, params, bindings=sizes, trace=trace)
    assert {n.op for n, _ in seen} >= {"mla_attention", "moe_route", "moe_experts", "kda_fused"}
    for i, (node, args) in enumerate(seen):
        group = KernelGroup(f"k{i:04d}_{node.op}", "triton", node.op, [node], list(node.inputs), list(node.outputs))
        inplace = [(1, 12), (2, 13)] if node.op == "kda_fused" else ()
        run_group(group, args, sizes, tmp_path, inplace=inplace)
