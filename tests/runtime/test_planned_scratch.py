"""Launches with planned scratch (schedule.json "scratch", `k3c.passes.plan_memory`) run on the arena's buffers and
allocate none of their own: k3.1-pro-tiny (MXFP4 MoE experts, chunked KDA prefill, DSA indexer) prefilled through
its artifact (conftest.py, shared with the end-to-end tests) with every kernel module's `take_scratch` guarded (a
launch that would allocate its scratch fails; each buffer it is handed lies inside the session's arena), and the
logits still match eager."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import k3c  # noqa: E402
from runtime_sizes import MAX_PREFILL  # noqa: E402

PRESET = "k3.1-pro-tiny"


def test_prefill_runs_on_planned_scratch_only(compiled, monkeypatch):
    _, art, model = compiled(PRESET)
    s = k3c.load(art, "cpu")
    lo = s.arena.data_ptr()
    hi = lo + s.arena.numel()
    handed: dict[str, int] = {}
    for name, mod in s.launchers["triton"].kernels.items():
        if not hasattr(mod, "take_scratch"):
            continue

        def guarded(scratch, key, shape, dtype, device, _take=mod.take_scratch, _name=name):
            assert scratch is not None, f"{_name} allocates its scratch {key!r}: no planned buffer was handed over"
            t = _take(scratch, key, shape, dtype, device)
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi, (_name, key)
            handed[_name.split("_", 2)[-1]] = handed.get(_name.split("_", 2)[-1], 0) + 1
            return t

        monkeypatch.setattr(mod, "take_scratch", guarded)
    tokens = torch.randint(0, model.config.vocab_size, (1, MAX_PREFILL), generator=torch.Generator().manual_seed(0))
    got = s.prefill(tokens)  # one call of MAX_PREFILL >= 16 tokens: KDA's chunked path
    with torch.no_grad():
        want = model(tokens)[0][:, -1:]
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
    cfg = model.config
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    # per launch: MXFP4 moe_experts takes y_slot, h and z_perm; the chunked KDA ws, ws_p and ws_glast (head_dim 16:
    # the norm epilogue is fused, no o_buf); the DSA indexer its sort keys
    assert handed == {"moe_experts": 3 * moe_layers, "kda_fused": 3 * len(cfg.kda_layers),
                      "dsa_index_topk": len(cfg.dsa_layers)}
