"""Decode step time of a k3c artifact on a CUDA GPU: CUDA graphs against launching every kernel from Python, and
where the first logits after a load go. Runs with whichever k3c is on PYTHONPATH, so two checkouts (e.g. piecewise
graphs before, whole-step graphs after) can be compared on the same GPU, one process each.

    python benchmarks/bench_decode_graphs.py --out OUT/ws.json [--preset k3.1-pro-tiny] [--first-logits]

Steps: a random bf16 checkpoint of the preset (seed 0) compiled for the H200 (--max-batch 8 --max-seq 4096
--max-prefill 256); for B in 1, 8 and a context of 2048 (set, not prefilled: the cache contents do not change a
step's work): the median of 50 `session.decode` calls (host check, replay, logits copy, synchronise) with CUDA
graphs and of 10 with every launch from Python. `--first-logits`: the artifact finalized (`k3c.load(...,
finalize=True)`), then a fresh process with an empty Triton cache loads it and prefills 256 tokens twice: load,
first and second prefill seconds, and the first prefill's ten costliest functions (cProfile, cumulative).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from e2e_measure import decode_tokens, timed  # this directory: the script's own sys.path entry

FIRST = textwrap.dedent("""
    import cProfile, io, json, pstats, sys, time
    import torch, k3c
    torch.zeros(1, device="cuda")
    t0 = time.perf_counter()
    s = k3c.load(sys.argv[1], "cuda")
    torch.cuda.synchronize(); t1 = time.perf_counter()
    tok = torch.randint(0, s.vocab, (1, 256))
    prof = cProfile.Profile()
    prof.enable()
    s.prefill(tok)
    torch.cuda.synchronize()
    prof.disable(); t2 = time.perf_counter()
    s.reset(); s.prefill(tok); torch.cuda.synchronize(); t3 = time.perf_counter()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    print(json.dumps({"load_s": t1 - t0, "first_prefill_s": t2 - t1, "second_prefill_s": t3 - t2,
                      "profile": text.getvalue()[-6000:]}))
""")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="k3.1-pro-tiny")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--first-logits", action="store_true")
    a = ap.parse_args()
    import k3c
    from k3c.compile import CompileOptions, compile_model
    from models.config import K3Config
    from models.k3 import save_random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="k3c-graphs-"))
    save_random_checkpoint(K3Config.from_pretrained(a.preset), work / "ckpt", seed=0, dtype=torch.float32)
    opts = CompileOptions(str(work / "ckpt"), work / "art", target="h200", max_batch=8, max_seq=4096,
                          max_prefill=256, dtype="bf16")
    compile_model(opts)
    res = {"preset": a.preset, "context": a.context, "k3c": k3c.__file__, "decode_ms": {}}
    for graphs in (True, False):
        s = k3c.load(opts.out, "cuda", cuda_graphs=graphs)
        for B in (1, 8):
            s.reset()
            tok = decode_tokens(B, s.vocab)

            def step():
                s.length, s.batch = a.context, B
                s.decode(tok)

            step()
            step()
            res["decode_ms"][f"{'graphs' if graphs else 'python'}_B{B}"] = timed(step, 50 if graphs else 10) * 1e3
        del s
    if a.first_logits:
        k3c.load(opts.out, "cuda", finalize=True)
        env = {**os.environ, "TRITON_CACHE_DIR": str(work / "fresh-cache")}
        p = subprocess.run([sys.executable, "-c", FIRST, str(opts.out)], env=env, capture_output=True, text=True)
        try:
            res["first_logits"] = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            res["first_logits"] = {"error": (p.stderr or p.stdout)[-3000:]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "first_logits"}, indent=1))
    if "first_logits" in res:
        print(res["first_logits"].get("profile", res["first_logits"]))
        print({k: v for k, v in res["first_logits"].items() if k != "profile"})


if __name__ == "__main__":
    main()
