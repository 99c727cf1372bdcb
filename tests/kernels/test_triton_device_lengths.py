"""Context-dependent decode kernels with the context length in device memory (`lengths` i32 [B]; whole-step CUDA
graphs, `k3c.runtime.graphs`), under the Triton interpreter, fp32, small shapes.

The key tensors are the bound (a pool cut to nothing); row b holds lengths[b] + T keys. Oracle: the IR references
(`mla_attention_ref`, `dsa_index_topk_ref`, k3c/ir/ops/model_attn.py) on each row's keys cut on the host, and the
kernels' own host-length launches. The rows' lengths differ, so each row takes its own split of the keys and its own
side of the DSA dense guard.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors need the interpreter; set before triton.jit runs

import pytest
import torch

from k3c.codegen.triton.attention import launch_mla
from k3c.codegen.triton.dsa_index import launch_dsa_index_topk
from k3c.codegen.triton.dsa_decode import radix_topk
from k3c.ir.ops.model_attn import dsa_index_topk_ref, mla_attention_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run the kernels under TRITON_INTERPRET=1")

H, DL, DV, J, DI = 4, 24, 16, 4, 16     # heads, latent + rope width, value width, indexer heads, index key width


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def per_row_ref(attrs, q, kv, idx, lengths):
    """mla_attention_ref on each row's keys (lengths[b] + 1), idx cut to the row's valid slots."""
    rows = []
    for b, n in enumerate((lengths + 1).tolist()):
        rows.append(mla_attention_ref(attrs, q[b:b + 1], kv[b:b + 1, :n], None,
                                      None if idx is None else idx[b:b + 1])[0])
    return torch.cat(rows)


@pytest.mark.parametrize("case", ["dense split-K", "dsa guard"])
def test_mla_attention_reads_lengths(case):
    if case == "dense split-K":   # 3 programs, bound 700 > MIN_KEYS_PER_SPLIT (256): 3 key splits per row
        bound, lengths, topk, guard = 700, torch.tensor([5, 640, 299], dtype=torch.int32), None, None
    else:                         # one row under the guard (dense), two above it (the idx slots)
        bound, lengths, topk, guard = 90, torch.tensor([8, 70, 89], dtype=torch.int32), 16, 16
    B = len(lengths)
    q, kv = rand(B, 1, H, DL, seed=1), rand(B, bound, DL, seed=2)
    attrs = {"absorbed": True, "causal": True, "scale": DL ** -0.5, "v_dim": DV, "dense_max_keys": guard}
    idx = None
    if topk:
        k_i = rand(B, bound, DI, seed=3)
        idx = torch.cat([dsa_index_topk_ref({"topk": topk}, rand(1, 1, J, DI, seed=4 + b), rand(1, 1, J, seed=9 + b),
                                            k_i[b:b + 1, :n + 1])[0] for b, n in enumerate(lengths.tolist())])
    out = torch.full((B, 1, H, DV), float("nan"))
    launch_mla(q, kv, None, idx, out, absorbed=True, causal=True, scale=attrs["scale"], v_dim=DV,
               dense_max_keys=guard, lengths=lengths)
    torch.testing.assert_close(out, per_row_ref(attrs, q, kv, idx, lengths), rtol=1e-5, atol=1e-5)


def test_dsa_index_topk_reads_lengths():
    bound, topk = 80, 16
    lengths = torch.tensor([3, 40, 79], dtype=torch.int32)   # fewer keys than topk, more, the whole bound
    B = len(lengths)
    q_i, w, k_i = rand(B, 1, J, DI, seed=5), rand(B, 1, J, seed=6), rand(B, bound, DI, seed=7)
    out = torch.empty(B, 1, topk, dtype=torch.int64)
    launch_dsa_index_topk(q_i, w, k_i, out, topk=topk, lengths=lengths)
    for b, n in enumerate((lengths + 1).tolist()):
        want = dsa_index_topk_ref({"topk": topk}, q_i[b:b + 1], w[b:b + 1], k_i[b:b + 1, :n])[0]
        assert torch.equal(out[b:b + 1], want), b


def test_radix_select_reads_lengths():
    # the radix select (decode at long context) on a bound of 1500 keys: rows of 201, 1100 and 1500 keys
    bound, topk = 1500, 64
    lengths = torch.tensor([200, 1099, 1499], dtype=torch.int32)
    B = len(lengths)
    q_i, w, k_i = rand(B, J, DI, seed=8), rand(B, J, seed=9), rand(B, bound, DI, seed=10)
    got = radix_topk(q_i, w, k_i, topk, None, False, lengths=lengths)                  # the set, in no order
    for b, n in enumerate((lengths + 1).tolist()):
        want = dsa_index_topk_ref({"topk": topk}, q_i[b:b + 1, None], w[b:b + 1, None], k_i[b:b + 1, :n])[0]
        assert torch.equal(got[b:b + 1].sort(-1).values, want.sort(-1).values), b


def test_lengths_shape_is_checked():
    q, kv = rand(2, 1, H, DL, seed=1), rand(2, 10, DL, seed=2)
    with pytest.raises(ValueError, match="lengths"):
        launch_mla(q, kv, None, None, torch.empty(2, 1, H, DV), absorbed=True, causal=True, scale=1.0, v_dim=DV,
                   dense_max_keys=None, lengths=torch.zeros(3, dtype=torch.int32))
