"""The main job on the built-in default model (`k3-tiny`): write a random checkpoint in the published layout,
load it back, run the reference model (a prefill, then greedy decode steps), then compile it with
`k3c compile --plan-only` (IR through the model passes, memory plan, pools, cost report). Prints what it did.

Usage: python examples/quickstart.py [--model k3-tiny] [--out build/k3-tiny] [--prompt-len 16] [--decode-steps 8]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from models.k3 import K3Config, load_checkpoint, save_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--out", default=None, help="checkpoint directory (default build/<model>)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=8)
    args = ap.parse_args()
    cfg = K3Config.from_pretrained(args.model)
    ckpt = Path(args.out or f"build/{cfg.name}")
    if ckpt.exists():
        shutil.rmtree(ckpt)
    t0 = time.perf_counter()
    save_random_checkpoint(cfg, ckpt, seed=0)
    print(f"wrote random checkpoint of {cfg.name} to {ckpt} ({time.perf_counter() - t0:.2f} s): {cfg.summary()}")
    model = load_checkpoint(ckpt)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t0 = time.perf_counter()
        logits, cache = model(prompt)
        t_prefill = time.perf_counter() - t0
        tokens = [int(logits[0, -1].argmax())]
        t0 = time.perf_counter()
        for _ in range(args.decode_steps - 1):
            logits, cache = model(torch.tensor([[tokens[-1]]]), cache)
            tokens.append(int(logits[0, -1].argmax()))
        t_decode = time.perf_counter() - t0
    print(f"prefill of {args.prompt_len} tokens: {t_prefill * 1e3:.1f} ms; "
          f"{args.decode_steps} greedy tokens: {tokens} ({t_decode * 1e3 / max(1, args.decode_steps - 1):.1f} ms/step)")


    from k3c.compile import CompileOptions, compile_model

    art = Path(f"build/{cfg.name}.plan")
    opts = CompileOptions(str(ckpt), art, max_batch=1, max_seq=256, max_prefill=args.prompt_len, force=True)
    if art.exists():
        shutil.rmtree(art)
    s = compile_model(opts)
    print(f"compiled {cfg.name} (plan only) to {art} in {s['seconds']:.1f} s: {s['nodes']} IR nodes after the model "
          f"passes; arena prefill {s['arena']['prefill']} B (liveness lower bound {s['lower_bound']['prefill']} B), "
          f"decode {s['arena']['decode']} B; cache pools {sum(s['pools'].values())} B")


if __name__ == "__main__":
    main()
