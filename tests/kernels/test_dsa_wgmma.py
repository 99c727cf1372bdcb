"""The wgmma (Gluon) sparse decode attention (k3c.codegen.triton.dsa_attention_wgmma): when the launcher takes it
(CPU) and, on a Hopper GPU, its output against `mla_attention_ref` and the Triton kernel it replaces there.

Oracle: `mla_attention_ref` (k3c/ir/ops/model_attn.py), fp32, on the same idx / lengths / dense guard.
"""

import types

import pytest
import torch

from k3c.codegen.triton import attention
from k3c.codegen.triton.dsa_attention_wgmma import sparse_wgmma_ok
from k3c.ir.ops.model_attn import mla_attention_ref

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs a Hopper (sm_90) GPU")


@pytest.mark.parametrize("major,dtype,dv,dr,row,ok", [(9, torch.bfloat16, 512, 64, 576, True),
                                                      (9, torch.float16, 256, 64, 320, True),
                                                      (10, torch.bfloat16, 512, 64, 576, False),
                                                      (9, torch.float32, 512, 64, 576, False),
                                                      (9, torch.bfloat16, 128, 64, 576, False),
                                                      (9, torch.bfloat16, 512, 32, 576, False),
                                                      (9, torch.bfloat16, 512, 64, 584, False)])
def test_launcher_picks_wgmma_on_hopper_only(monkeypatch, major, dtype, dv, dr, row, ok):
    """sm_90 only, bf16 / fp16, K3's row split (DV 256 / 512 + DR 64), kv rows `row` elements apart (a multiple of
    16: the cp.async gathers' alignment); never for CPU tensors."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    q = types.SimpleNamespace(is_cuda=True, dtype=dtype, device="cuda:0")
    kv = types.SimpleNamespace(dtype=dtype, shape=(2, 100, dv + dr), stride=lambda d: (100 * row, row, 1)[d],
                               data_ptr=lambda: 1 << 20)
    assert sparse_wgmma_ok(q, kv, dv) is ok
    assert not sparse_wgmma_ok(q, types.SimpleNamespace(**{**vars(kv), "dtype": torch.float16 if dtype ==
                                                           torch.bfloat16 else torch.bfloat16}), dv)
    assert not sparse_wgmma_ok(torch.zeros(1, dtype=dtype), kv, dv)         # CPU tensors: the Triton kernel


def _case(B, H, S, topk, seed, lengths=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 1, H, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(B, S, 576, device="cuda", generator=gen).bfloat16()
    n = torch.full((B,), S, device="cuda") if lengths is None else lengths.long() + 1
    idx = torch.stack([torch.randperm(S, device="cuda", generator=gen)[:topk] for _ in range(B)])
    idx = torch.where(idx < n[:, None], idx, -1)                        # slots past a row's keys: none
    idx[:, ::7] = -1
    return q, kv, idx[:, None].contiguous()


def _run(q, kv, idx, wgmma, lengths=None, dense_max=None):
    attention.SPARSE_WGMMA = wgmma
    try:
        out = torch.full((*q.shape[:3], 512), float("nan"), dtype=q.dtype, device="cuda")
        attention.launch_mla(q, kv, None, idx, out, absorbed=True, causal=True, scale=576 ** -0.5, v_dim=512,
                             dense_max_keys=dense_max, lengths=lengths)
        return out.float()
    finally:
        attention.SPARSE_WGMMA = True


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("B,H,S,topk", [(2, 16, 700, 256), (3, 96, 5000, 2048), (16, 96, 3000, 2048)])
def test_wgmma_matches_reference(B, H, S, topk):
    """64-head blocks (16 heads: one masked block; 96: a second half-masked one), 1 to 4+ key splits, -1 slots."""
    q, kv, idx = _case(B, H, S, topk, seed=B + S)
    attrs = dict(absorbed=True, causal=True, scale=576 ** -0.5, v_dim=512, dense_max_keys=None)
    want = mla_attention_ref(attrs, q.cpu().float(), kv.cpu().float(), None, idx.cpu())[0]
    got, old = _run(q, kv, idx, True).cpu(), _run(q, kv, idx, False).cpu()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-2 * scale
    assert (got - old).abs().max().item() <= 2e-2 * scale


@hopper
@pytest.mark.gpu
def test_wgmma_device_lengths_and_dense_guard():
    """Device lengths: a row under the dense guard (keys 0..len, idx unread) beside sparse rows of other lengths."""
    B, H, S, topk, guard = 3, 96, 4000, 2048, 2048
    lengths = torch.tensor([1000, 3999, 2500], dtype=torch.int32, device="cuda")
    q, kv, idx = _case(B, H, S, topk, seed=9, lengths=lengths)
    got = _run(q, kv, idx, True, lengths, guard).cpu()
    attrs = dict(absorbed=True, causal=True, scale=576 ** -0.5, v_dim=512, dense_max_keys=guard)
    for b, n in enumerate(lengths.tolist()):
        want = mla_attention_ref(attrs, q[b:b + 1].cpu().float(), kv[b:b + 1, :n + 1].cpu().float(), None,
                                 idx[b:b + 1].cpu())[0]
        assert (got[b:b + 1] - want).abs().max().item() <= 2e-2 * want.abs().max().item(), b


_SCRIPT = """
import sys, torch
from k3c.codegen.triton.attention import launch_mla
g = torch.Generator(device="cuda").manual_seed(3)
q = torch.randn(1, 1, 64, 576, device="cuda", generator=g).bfloat16()
kv = torch.randn(1, 900, 576, device="cuda", generator=g).bfloat16()
idx = torch.randperm(900, device="cuda", generator=g)[None, None, :320].contiguous()
out = torch.empty(1, 1, 64, 512, dtype=torch.bfloat16, device="cuda")
launch_mla(q, kv, None, idx, out, absorbed=True, causal=True, scale=0.05, v_dim=512, dense_max_keys=None)
torch.save(out.cpu(), sys.argv[1])
"""


@hopper
@pytest.mark.gpu
def test_captured_wgmma_kernel_loads_without_compiling(tmp_path):
    """What `finalize` ships (kernel_cache.collect of the cache the launch compiled into) holds the Gluon kernel,
    and a process whose cache holds only those entries (kernel_cache.install) compiles nothing and gives the same
    output."""
    import os
    import subprocess
    import sys

    from k3c.runtime import kernel_cache

    def run(cache, name):
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
        subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / name)], env=env, check=True)
        return torch.load(tmp_path / name)

    first = run(tmp_path / "a", "a.pt")
    files = kernel_cache.collect(tmp_path / "a", torch.device("cuda"))
    assert any(f.endswith("/mla_sparse_decode_wgmma_kernel.cubin") for f in files)
    with kernel_cache.capture() as fresh:
        kernel_cache.install(types.SimpleNamespace(files=list(files), read_bytes=files.__getitem__), "cuda")
        again = run(fresh, "b.pt")
        suffixes = {p.suffix for p in fresh.rglob("*") if p.is_file()}
    assert ".ttgir" not in suffixes and ".llir" not in suffixes and ".cubin" in suffixes, suffixes
    assert torch.equal(first, again)



AOT_WGMMA = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("emitted_mla_attention", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from k3c.codegen.triton.offline import compile_for, resources, sass
splits = int(sys.argv[2])
out = "*fp32" if splits > 1 else "*bf16"     # split-K partials are f32; one split writes o in q's dtype
sig = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i64", o_ptr=out, lse_ptr=out, len_ptr="*i32", S="i32",
           keys_per_split="i32", dense_max="i32", stride_kb="i32", stride_ks="i32", qk_scale="fp32")
consts = dict(H=64, DV=512, DR=64, TOPK=2048, SPLITS=splits, LEN_FROM_PTR=True, BLOCK_S=module.WGMMA_BLOCK_S,
              STAGES=module.WGMMA_STAGES)
c = compile_for(module.mla_sparse_decode_wgmma_kernel, sig, consts, num_warps=8,
                divisible=[n for n in sig if n.endswith("_ptr")] + ["stride_kb", "stride_ks"])
ops = [ins.split()[1] if ins.startswith("@") else ins.split()[0] for _, ins in sass(c.asm["cubin"])]
print(resources(c.asm["cubin"])["LOCAL"], c.metadata.shared, sum(o.startswith("LDGSTS") for o in ops),
      sum(o.startswith("HGMMA") for o in ops))
"""


@pytest.mark.parametrize("splits", [1, 4])
def test_wgmma_kernel_compiles_for_sm90(splits, tmp_path):
    # Gluon has no interpreter: the kernel as an artifact holds it (an emitted mla_attention module, its helpers
    # pasted with it) compiled for sm_90a ahead of time (no GPU; a process without TRITON_INTERPRET) with the
    # installed Triton, at K3's shapes. The cp.async gathers exist (Gluon renamed that builtin and the barrier
    # between Triton 3.6 and 3.9: k3c.codegen.triton.gl_common), wgmma is used, nothing spills, and the ring of
    # WGMMA_STAGES slots of 64 keys x 576 bf16 plus q (64 heads x 576) fits the 227 KB a CTA may have
    import os
    import subprocess
    import sys

    from k3c.ir.graph import Graph
    from k3c.ir.kernels import KernelGroup
    from k3c.ir.types import TensorType

    g = Graph()
    ins = [g.add_input(f"in{i}", TensorType(s, "bf16" if i < 2 else "i64"))
           for i, s in enumerate([(2, 1, 64, 576), (2, 4096, 576), (2, 1, 2048)])]
    outs = g.add_node("mla_attention", ins, {"absorbed": True, "scale": 576 ** -0.5, "v_dim": 512}, name_hint="mla")
    path = tmp_path / "k0001_mla_attention.py"
    path.write_text(attention.emit_mla_attention(KernelGroup("k0001_mla_attention", "triton", "mla_attention",
                                                             [g.nodes[0]], ins, outs)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", AOT_WGMMA, str(path), str(splits)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    spills, shared, copies, wgmma = map(int, run.stdout.split())
    assert spills == 0 and copies > 0 and wgmma > 0
    assert (attention.WGMMA_STAGES * attention.WGMMA_BLOCK_S + 64) * 576 * 2 <= shared <= 227 * 1024
