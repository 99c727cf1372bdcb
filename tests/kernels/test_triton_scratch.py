"""Launch functions on planned scratch (`take_scratch`, k3c/codegen/triton/__init__.py), under the Triton
interpreter, fp32, small shapes: handed NaN-filled buffers of the declared shapes (inside a larger "arena"), each
launch writes them and gives what its allocating form gives; a buffer of another shape is refused. The declarations
(`*_scratch`) are checked against the launch functions' shapes through these same calls: a mismatch raises.

MLA split-K: 3 programs over 200 keys (> MIN_KEYS_PER_SPLIT) split the keys; DSA: the key scratch capped below
B·T·L (SCRATCH_BYTES lowered) takes several passes over T; MoE: dense experts, every (token, slot) row.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors need the interpreter; set before triton.jit runs

import pytest
import torch

from k3c.codegen.triton import attention, dsa_index, moe, take_scratch
from k3c.ir.ops.model_attn import dsa_index_topk_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run the kernels under TRITON_INTERPRET=1")


NO_KERNEL_OPS = {"aten::select", "aten::slice", "aten::view", "aten::as_strided", "aten::empty", "aten::alias",
                 "aten::reshape", "aten::contiguous", "aten::empty_strided"}   # views / allocations: no launch


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def planned(shapes: dict[str, tuple], dtype=torch.float32) -> tuple[dict, torch.Tensor]:
    """NaN-filled buffers of `shapes` cut from one arena (with a NaN gap after each), and the arena."""
    sizes = [torch.Size(s).numel() for s in shapes.values()]
    arena = torch.full((sum(sizes) + 8 * len(sizes),), float("nan"), dtype=dtype)
    out, at = {}, 0
    for (name, shape), n in zip(shapes.items(), sizes):
        out[name] = arena[at:at + n].view(shape)
        at += n + 8
    return out, arena


def written(buf: torch.Tensor) -> bool:
    return bool((~torch.isnan(buf.float())).any())


def test_take_scratch_refuses_a_buffer_of_another_shape_or_dtype():
    buf = torch.empty(4, 3)
    assert take_scratch({"x": buf}, "x", (4, 3), torch.float32, "cpu") is buf
    assert take_scratch(None, "x", (2, 5), torch.float32, "cpu").shape == (2, 5)
    for scratch, shape, dtype in (({"x": buf}, (3, 4), torch.float32), ({"x": buf}, (4, 3), torch.float64),
                                  ({}, (4, 3), torch.float32)):
        with pytest.raises(ValueError, match="planned scratch 'x'"):
            take_scratch(scratch, "x", shape, dtype, "cpu")


def test_mla_split_k_partials_in_planned_scratch():
    B, S, H, DL, DV = 3, 200, 4, 24, 16
    q, kv = rand(B, 1, H, DL, seed=1), rand(B, S, DL, seed=2)
    args = dict(absorbed=True, causal=True, scale=DL ** -0.5, v_dim=DV, dense_max_keys=None)
    want = torch.empty(B, 1, H, DV)
    attention.launch_mla(q, kv, None, None, want, **args)
    rows = attention.split_rows(B, H, True)
    scratch, arena = planned({"o_part": (rows * H * DV,), "lse": (rows * H,)})
    got = torch.empty(B, 1, H, DV)
    attention.launch_mla(q, kv, None, None, got, scratch=scratch, **args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert written(scratch["o_part"]) and written(scratch["lse"])
    with pytest.raises(ValueError, match="planned scratch 'lse'"):
        attention.launch_mla(q, kv, None, None, got, scratch={**scratch, "lse": scratch["lse"][:-1]}, **args)


def test_dsa_keys_in_planned_scratch_over_several_passes(monkeypatch):
    B, T, L, J, D, topk = 2, 5, 1100, 4, 16, 8   # L > RADIX_ROW_PAD: the buffer's radix words fit in 2 rows of T
    monkeypatch.setattr(dsa_index, "SCRATCH_BYTES", 8 * B * 2 * L)  # two rows of T per pass: passes of 2, 2, 1
    q_i, w, k_i = rand(B, T, J, D, seed=3), rand(B, T, J, seed=4), rand(B, L, D, seed=5)
    want = torch.empty(B, T, topk, dtype=torch.int64)
    dsa_index.launch_dsa_index_topk(q_i, w, k_i, want, topk=topk)
    scratch, _ = planned({"keys": (max(B * (L + dsa_index.RADIX_ROW_PAD), min(dsa_index.SCRATCH_BYTES // 8,
                                                                              B * T * L)),)}, torch.float64)
    scratch = {"keys": scratch["keys"].view(torch.int64)}
    got = torch.empty(B, T, topk, dtype=torch.int64)
    dsa_index.launch_dsa_index_topk(q_i, w, k_i, got, topk=topk, scratch=scratch)
    assert torch.equal(got, want)
    assert scratch["keys"].numel() == B * 2 * L


def test_moe_experts_h_and_slot_outputs_in_planned_scratch():
    N, k, E, D, I = 5, 2, 4, 32, 48
    z = rand(N, D, seed=6)
    ids = torch.rand(N, E, generator=torch.Generator().manual_seed(7)).argsort(-1)[:, :k].contiguous()
    ids[1, 1] = -1  # an unused slot
    wt = torch.rand(N, k, generator=torch.Generator().manual_seed(8))
    w1, w3, w2 = rand(E, I, D, seed=9) * 0.2, rand(E, I, D, seed=10) * 0.2, rand(E, D, I, seed=11) * 0.2
    attrs = {"act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}
    want = torch.empty(N, D)
    moe.launch_moe_experts(z, wt, ids, w1, w3, w2, y=want, **attrs)
    scratch, _ = planned({"h": (N * k, I), "y_slot": (N * k, D)})
    got = torch.empty(N, D)
    moe.launch_moe_experts(z, wt, ids, w1, w3, w2, y=got, scratch=scratch, **attrs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert written(scratch["h"]) and written(scratch["y_slot"])
    with pytest.raises(ValueError, match=r"tiled=2 is a layout of MXFP4 words; these experts are dense"):
        moe.launch_moe_experts(z, wt, ids, w1, w3, w2, y=got, tiled=2, **attrs)


def test_moe_route_and_experts_read_column_views_in_place():
    # the decode GEMM's output [N, 3 + E + D] split into columns: logits and z are row-strided views
    N, k, E, D, I = 5, 2, 4, 32, 48
    wide = rand(N, 3 + E + D, seed=12)
    logits, z = wide[:, 3:3 + E], wide[:, 3 + E:]
    assert not logits.is_contiguous() and not z.is_contiguous()
    bias = rand(E, seed=13)
    got_w, got_i = torch.empty(N, k), torch.empty(N, k, dtype=torch.int64)
    want_w, want_i = torch.empty(N, k), torch.empty(N, k, dtype=torch.int64)
    args = {"top_k": k, "scaling": 1.5, "renormalize": True}
    moe.launch_moe_route(logits, bias, got_w, got_i, **args)
    moe.launch_moe_route(logits.contiguous(), bias, want_w, want_i, **args)
    assert torch.equal(got_w, want_w) and torch.equal(got_i, want_i)
    w1, w3, w2 = rand(E, I, D, seed=9) * 0.2, rand(E, I, D, seed=10) * 0.2, rand(E, D, I, seed=11) * 0.2
    attrs = {"act": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}
    got, want = torch.empty(N, D), torch.empty(N, D)
    moe.launch_moe_experts(z, got_w, got_i, w1, w3, w2, y=got, **attrs)
    moe.launch_moe_experts(z.contiguous(), want_w, want_i, w1, w3, w2, y=want, **attrs)
    assert torch.equal(got, want)


def test_dsa_radix_select_on_planned_scratch_runs_no_torch_op(monkeypatch):
    # decode through the radix select (RADIX_MIN_KEYS lowered): NaN-filled planned scratch (nothing arrives zeroed),
    # the set written into `out` in place: four Triton launches and no aten op that computes (a kernel launch on a
    # GPU) outside them (the interpreter's own argument copies run inside a "triton launch" range)
    from torch.profiler import ProfilerActivity, profile, record_function
    from triton.runtime.interpreter import InterpretedFunction

    launches = []

    def run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        with record_function("triton launch"):
            return plain_run(self, *args, **kwargs)

    plain_run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", run)
    B, L, J, D, topk = 2, 700, 4, 16, 32
    monkeypatch.setattr(dsa_index, "RADIX_MIN_KEYS", 1)
    q_i, w, k_i = rand(B, 1, J, D, seed=12), rand(B, 1, J, seed=13), rand(B, L, D, seed=14)
    scratch, _ = planned({"keys": (max(B * (L + dsa_index.RADIX_ROW_PAD), min(dsa_index.SCRATCH_BYTES // 8,
                                                                              B * L)),)}, torch.float64)
    scratch = {"keys": scratch["keys"].view(torch.int64)}
    out = torch.full((B, 1, topk), 12345, dtype=torch.int64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dsa_index.launch_dsa_index_topk(q_i, w, k_i, out, topk=topk, scratch=scratch)
    want = dsa_index_topk_ref({"topk": topk}, q_i, w, k_i)[0]
    assert torch.equal(out.sort(-1).values, want.sort(-1).values)
    top = [ev.name for ev in prof.events() if ev.cpu_parent is None and ev.name.startswith("aten::")]
    assert not [n for n in top if n not in NO_KERNEL_OPS], top
    assert launches == ["dsa_init_kernel", "dsa_scan_kernel", "dsa_collect_kernel", "dsa_refine_kernel",
                        "dsa_finish_kernel"]
