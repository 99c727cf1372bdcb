"""`--kda-state bf16` (`CompileContext.kda_state_dtype`): the KDA recurrent state stored in bf16, computed in f32.

One small K3-structured checkpoint (one KDA layer, 2 heads of 16, AttnRes, MoE; f32 weights) compiled once per
module for the h200 target (Triton kernels, interpreted on CPU) with `dtype="f32", kda_state_dtype="bf16"`, so the
state's rounding is the only bf16 in the artifact. Checked against independent computations:
- structure: the cache input, the pool (B·H·K·V·2 bytes from the config, half of f32's 4), the manifest, the KDA
  launch reading the pool directly (the import's casts folded into `kda_fused`), a second compile byte-identical,
  the pool split over heads at --tp 2;
- the reference interpreter (the artifact's own graphs, `kda_fused_ref`) against `models/k3.py` eager started
  from the same bf16 state in f32, its new state rounded to bf16 (round to nearest even) once per call;
- the compiled artifact: prefill (16 tokens: the chunked KDA kernel) then decode steps (the decode kernel), each
  call against eager started from the artifact's caches before it, and the run against eager with an f32 state;
- the TVM backend's compile-time refusal.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.codegen.tvm.backend import TvmBackend  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from k3c.errors import UnsupportedError  # noqa: E402
from k3c.ir import serialize  # noqa: E402
from k3c.ir.interp import interpret  # noqa: E402
from k3c.ir.kernels import kernel_groups  # noqa: E402
from k3c.passes.derived import materialize_params  # noqa: E402
from k3c.targets import load_target  # noqa: E402
from models.config import _TINY_COMMON, K3Config, _shrink  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402

B, H, K, W = 2, 2, 16, 4          # batch, KDA heads, head dim, conv width
PROMPT, MAX_SEQ, STEPS = 16, 20, 2  # one full 16-token chunk (the chunked prefill kernel), then decode steps
STATE = "layers.0.kda_state"

pytestmark = pytest.mark.slow  # compiles an artifact and interprets it: `make test`, not `make test-quick`


def _config() -> K3Config:
    """K3's structure at the smallest size: one KDA layer (lower-bound gate: the chunked prefill runs)."""
    over = dict(_TINY_COMMON, num_hidden_layers=1, vocab_size=64, q_lora_rank=32, routed_expert_hidden_size=32,
                attn_res_block_size=2, num_shared_experts=1)
    return _shrink("kda-state-tiny", "k3", linear_attn_config=dict(kda_layers=[1], full_attn_layers=[], num_heads=H,
                                                                    head_dim=K), **over)


def _opts(root, out: str, **kw) -> CompileOptions:
    return CompileOptions(str(root / "ckpt"), root / out, target="h200", dtype="f32", max_batch=B,
                          max_seq=MAX_SEQ, max_prefill=PROMPT, kda_state_dtype="bf16", **kw)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """(eager fp32 model, artifact dir, checkpoint root)."""
    root = tmp_path_factory.mktemp("kda-state")
    model = save_random_checkpoint(_config(), root / "ckpt", seed=3, dtype=torch.float32)
    opts = _opts(root, "art")
    compile_model(opts)
    return model.eval(), opts.out, root


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 (round to nearest even) and back to f32."""
    return t.to(torch.bfloat16).float()


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 `got` against f32 `want`: every element within one bf16 ulp (2^-7 relative), and at least 90% of them
    exactly `want` rounded to nearest even (torch, CUDA) or truncated (Triton's interpreter rounds toward zero);
    the rest are near a rounding boundary, where the last bits of an fp32 sum in another order move them by one."""
    assert got.dtype == torch.bfloat16
    want = want.float().contiguous()
    err = (got.float() - _bf16(want)).abs()
    assert (err <= want.abs() * 2 ** -7 + 1e-30).all(), f"beyond one bf16 ulp: {err.max().item()}"
    truncated = (want.view(torch.int32) & -65536).view(torch.float32)
    assert max((got.float() == r).float().mean() for r in (_bf16(want), truncated)) > 0.9


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_state_is_bf16_from_import_to_pool(art):
    model, path, root = art
    manifest = json.loads((path / "manifest.json").read_text())
    plan = json.loads((path / "plan.json").read_text())
    sched = json.loads((path / "schedule.json").read_text())
    assert manifest["extra"]["kda_state_dtype"] == "bf16" and manifest["extra"]["dtype"] == "f32"
    assert plan["pools"][STATE] == {"shape": [B, H, K, K], "dtype": "bf16", "bytes": B * H * K * K * 2}
    assert plan["pools"]["layers.0.conv_state"]["dtype"] == "f32"  # only the recurrent state changes
    for entry, e in sched.items():
        assert e["values"][STATE]["dtype"] == "bf16"
        (kda,) = [ln for ln in e["launches"] if ln["kind"] == "kda_fused"]
        assert STATE in kda["inputs"], entry  # the pool itself: no cast launch in between
        assert not any(STATE in ln["inputs"] for ln in e["launches"] if ln is not kda)
        assert e["values"][e["outputs"][STATE]]["dtype"] == "bf16"
    # the same options compile to the same bytes (plan-only: no weights or kernels, the same graphs and plans)
    again = _opts(root, "again", plan_only=True)
    compile_model(again)
    for rel in ("plan.json", "schedule.json", "graph/prefill.json", "graph/decode.json"):
        assert (again.out / rel).read_bytes() == (path / rel).read_bytes(), rel
    # tensor parallel: each of 2 ranks holds half the heads of the state, still bf16
    tp2 = _opts(root, "tp2", plan_only=True, tp=2)
    compile_model(tp2)
    pool = json.loads((tp2.out / "plan.json").read_text())["pools"][STATE]
    assert pool == {"shape": [B, H // 2, K, K], "dtype": "bf16", "bytes": B * H // 2 * K * K * 2}


def test_interpreter_rounds_the_state_once_per_call(art):
    """The artifact's graphs interpreted from a nonzero bf16 state: prefill (5 tokens) and decode match eager in f32
    started from the same state, and the new state is eager's rounded to bf16 (within one ulp, mostly exact)."""
    model, path, _ = art
    named = {k: p.detach() for k, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    state = (torch.randn(B, H, K, K, generator=gen) * 0.3).to(torch.bfloat16)
    conv = torch.randn(B, 3 * H * K, W, generator=gen)
    for entry, T in (("prefill", 5), ("decode", 1)):
        g = serialize.load(path / "graph" / f"{entry}.json")
        tokens = torch.randint(0, 64, (B, T), generator=gen)
        out = interpret(g, {"tokens": tokens, STATE: state, "layers.0.conv_state": conv},
                        materialize_params(g, named), bindings={"B": B, "T": T, "L": 0})
        cache = model.new_cache(B)
        cache[STATE], cache["layers.0.conv_state"] = state.float(), conv
        with torch.no_grad():
            logits, new = model(tokens, cache)
        assert _rel(out["logits"][:, -1], logits[:, -1]) < 1e-5, entry
        _within_one_ulp(out[STATE], new[STATE])


def test_compiled_prefill_then_decode_match_eager(art):
    """Each call (a 16-token prefill: the chunked kernel; then decode steps) against eager started from the
    artifact's caches before it: logits within 1e-4 of max |logit| (f32 everywhere but the state's storage), the new
    state within one bf16 ulp of eager's, rounded (measured 3e-7). Over the whole run, against eager keeping an f32
    state: within 5e-3, the bf16 state's accuracy band on this model (measured 4.6e-4 and 1.0e-3 after one and two
    decode steps)."""
    model, path, _ = art
    session = k3c.load(path, "cpu")
    tokens = torch.randint(0, 64, (B, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    f32_cache = model.new_cache(B)
    for i, (t0, t1) in enumerate([(0, PROMPT)] + [(PROMPT + s, PROMPT + s + 1) for s in range(STEPS)]):
        chunk = tokens[:, t0:t1]
        cache = {**f32_cache, **{k: v.float().clone() for k, v in session.pools.items()}}
        got = session.prefill(chunk)[:, -1] if i == 0 else session.decode(chunk)[:, 0]
        with torch.no_grad():
            logits, cache = model(chunk, cache)
            f32_logits, f32_cache = model(chunk, f32_cache)
        assert _rel(got, logits[:, -1]) < 1e-4, i
        _within_one_ulp(session.pools[STATE], cache[STATE])
        assert _rel(got, f32_logits[:, -1]) < 5e-3, i


def test_tvm_backend_refuses_a_bf16_state(art):
    """At compile time: when the TVM backend claims the KDA launch, its `launch_record` (which `k3c compile` asks of
    every launch, plan-only too) raises, naming the option and the backend. (The option's value errors: test_context,
    test_retarget, test_cli.)"""
    _, path, _ = art
    g = serialize.load(path / "graph" / "decode.json")
    (group,) = [grp for grp in kernel_groups(g) if grp.kind == "kda_fused"]
    tvm = TvmBackend(load_target("cpu-x86-64"))
    assert tvm.claims(group.kind, group.nodes)
    with pytest.raises(UnsupportedError, match=r"^--kda-state bf16 \(kda_state_dtype\): the tvm backend keeps"):
        tvm.launch_record(group)
