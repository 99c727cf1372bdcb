"""The main job on the built-in default model (`k3-tiny`), end to end on a CPU:

1. write a random checkpoint in the published layout (sharded safetensors, `language_model.` prefix);
2. `k3c compile` it for `cpu-x86-64`: import -> passes -> TVM kernels (one native shared library), memory plan,
   schedule, weights -> artifact directory;
3. `k3c.load` the artifact and run it natively (the kernel library loads with apache-tvm-ffi):
   a prefill, then greedy decode steps; the logits are compared with the reference model (`models/k3.py`).

Usage: python examples/quickstart.py [--model k3-tiny] [--prompt-len 16] [--decode-steps 8]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import k3c
from k3c.compile import CompileOptions, compile_model
from models.k3 import K3Config, save_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=8)
    args = ap.parse_args()
    cfg = K3Config.from_pretrained(args.model)
    root = Path("build") / cfg.name
    if root.exists():
        shutil.rmtree(root)
    model = save_random_checkpoint(cfg, root / "ckpt", seed=0, dtype=torch.float32).eval()
    print(f"1. wrote a random checkpoint of {cfg.name} to {root / 'ckpt'}: {cfg.summary()}")

    t0 = time.perf_counter()
    opts = CompileOptions(str(root / "ckpt"), root / "artifact", target="cpu-x86-64", max_batch=1,
                          max_seq=args.prompt_len + args.decode_steps, max_prefill=args.prompt_len, dtype="f32")
    s = compile_model(opts)
    print(f"2. compiled to {opts.out} in {time.perf_counter() - t0:.1f} s: {s['nodes']['prefill']} IR nodes, "
          f"{s['kernels']} TVM kernels; arena prefill {s['arena']['prefill']} B (liveness lower bound "
          f"{s['lower_bound']['prefill']} B); cache pools {sum(s['pools'].values())} B")

    session = k3c.load(opts.out, "cpu")
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    logits = session.prefill(prompt)
    with torch.no_grad():
        want, cache = model(prompt)
    want = want[:, -1:]  # prefill returns the last position's logits
    worst = float((logits - want).abs().max() / want.abs().max())
    tokens, step_s = [int(logits[0, -1].argmax())], []
    for _ in range(args.decode_steps - 1):
        nxt = torch.tensor([[tokens[-1]]])
        logits = session.decode(nxt)
        step_s.append(session.last_timing["seconds"])
        with torch.no_grad():
            want, cache = model(nxt, cache)
        worst = max(worst, float((logits - want).abs().max() / want.abs().max()))
        tokens.append(int(logits[0, -1].argmax()))
    print(f"3. ran the artifact: greedy tokens {tokens}; max relative logit error vs models/k3.py {worst:.2e}; "
          f"decode {sum(step_s) / max(1, len(step_s)) * 1e3:.1f} ms/step (native TVM kernels, GEMVs included; "
          "prefill GEMMs are torch calls)")


if __name__ == "__main__":
    main()
