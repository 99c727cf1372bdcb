"""Build the inputs of `gpu_artifact_check.py` on CPU: a random k3.1-pro-tiny checkpoint and its bf16 and f32
artifacts for the h200 target; with --stable-routing the MoE selection bias is set to arange(E) so that no token's
top-k expert choice can flip under rounding (a numerics check free of discrete routing decisions). With --mxfp4 the
checkpoint stores its routed experts as MXFP4 (like the published K3 checkpoints): the artifacts keep them 4-bit,
and a third artifact `art_bf16_experts` (bf16, `--experts-dtype bf16`) is the dequantized build to compare with.

Usage: python benchmarks/make_gpu_check_inputs.py --out build/gpu [--stable-routing] [--mxfp4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3c.compile import CompileOptions, compile_model
from models.k3 import K3Config, save_random_checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stable-routing", action="store_true")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts in the checkpoint")
    a = ap.parse_args()
    ckpt = a.out / "ckpt"
    save_random_checkpoint(K3Config.from_pretrained("k3.1-pro-tiny"), ckpt, seed=1, dtype=torch.float32,
                           expert_format="mxfp4" if a.mxfp4 else "dense")
    if a.stable_routing:
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
        for shard in sorted(set(index.values())):
            tensors = load_file(str(ckpt / shard))
            keys = [k for k in tensors if k.endswith("e_score_correction_bias")]
            for k in keys:
                tensors[k] = torch.arange(tensors[k].numel(), dtype=tensors[k].dtype)
            if keys:
                save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    builds = [("bf16", "art", None), ("f32", "art32", None)]
    if a.mxfp4:
        builds.append(("bf16", "art_bf16_experts", "bf16"))
    for dtype, name, experts in builds:
        compile_model(CompileOptions(str(ckpt), a.out / name, target="h200", max_batch=3, max_seq=96, max_prefill=64,
                                     dtype=dtype, experts_dtype=experts))
    print(f"wrote {ckpt} and " + ", ".join(str(a.out / name) for _, name, _ in builds))


if __name__ == "__main__":
    main()
