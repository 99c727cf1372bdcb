"""Launches per decode step, on a CPU: `k3c.runtime.census` on a tiny model with bench_e2e.py's layer layout.

bench_e2e.py's model (K3.1 Pro, 4 layers: layer 0 dense, KDA 1-3, DSA 4; 32 experts choosing 16) at the
k3.1-pro-tiny widths, a random f32 checkpoint, compiled for the h200 target (Triton kernels, run in the
interpreter here), a short prompt prefilled, one decode step (the eager one a GPU runs before capturing its
graph), then one decode step counted. On a CPU the MoE tile schedule runs as torch ops (`moe_schedule`: about 26
launches per MoE layer) where a GPU runs one `moe_schedule_kernel`. The launch counts depend on the
schedule and the launchers, not on the widths, so they are those of the full-width model (bf16 adds the router's
f32 linear: a library launch of its own). Prints the schedule launches that start device work and the totals;
`--json FILE` writes them.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/launch_census.py --batch 4      # ~1 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("K3C_CACHE_DIR", "off")
sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32,
            routed_expert_hidden_size=32, num_shared_experts=2)


def tiny_bench_config():
    """bench_e2e.py's layer layout (4 layers, 32 experts choosing 16) at the k3.1-pro-tiny widths."""
    from models.config import K3Config

    raw = json.loads((Path(__file__).parents[1] / "models/configs/kimi-k3.1-pro.json").read_text())
    t = raw["text_config"]
    t.pop("quantization_config", None)
    t.update(TINY, num_hidden_layers=4, num_experts=32, num_experts_per_token=16, first_k_dense_replace=1)
    t["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=4, head_dim=16)
    t["dsa_config"].update(dsa_layers=[4], index_num_heads=4, index_head_dim=16, index_topk=16)
    return K3Config.from_dict(raw, source="launch_census", name="k3.1-pro-4L-32E-tiny")


def build(root: Path, batch: int) -> Path:
    """A random f32 checkpoint of `tiny_bench_config()` compiled (h200, Triton) under root; returns the artifact."""
    from k3c.compile import CompileOptions, compile_model
    from models.k3 import save_random_checkpoint

    save_random_checkpoint(tiny_bench_config(), root / "ckpt", seed=0, dtype=torch.float32)
    compile_model(CompileOptions(model=str(root / "ckpt"), out=root / "art", dtype="f32", max_batch=batch,
                                 max_seq=64, max_prefill=16))
    return root / "art"


def run(art: Path, batch: int, prompt: int = 4):
    """Load `art` on the CPU, prefill `prompt` tokens per row and count one decode step: (rows, summary)."""
    import k3c
    from k3c.runtime.census import census, summary

    session = k3c.load(art, "cpu")
    g = torch.Generator().manual_seed(0)
    session.prefill(torch.randint(0, session.vocab, (batch, prompt), generator=g))
    session.decode(torch.randint(0, session.vocab, (batch, 1), generator=g))   # the eager step before a capture
    rows = census(session, torch.randint(0, session.vocab, (batch, 1), generator=g))
    return rows, summary(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows, s = run(build(Path(tmp), a.batch), a.batch)
    for r in rows:
        if r.total:
            parts = [f"{k} x{v}" if v > 1 else k for k, v in {**r.triton, **r.aten}.items()]
            print(f"{r.name:36s} {r.kind:16s} {r.total:3d}  {', '.join(parts)}")
    print(f"launches per decode step: {s['launches']} ({s['schedule_launches']} schedule launches)")
    print("glue (ATen ops of Triton launches, frame, lengths):", json.dumps(s["glue"]))
    if a.json:
        a.json.write_text(json.dumps({"batch": a.batch, **s, "rows": [
            {"name": r.name, "kind": r.kind, "backend": r.backend, "triton": dict(r.triton), "aten": dict(r.aten)}
            for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
