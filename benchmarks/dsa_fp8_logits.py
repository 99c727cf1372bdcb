"""End-to-end logits error of FP8 DSA index keys on k3.1-pro-tiny (CPU, fp32 model, random weights).

Runs the reference model (models/k3.py) on a prompt and teacher-forced decode steps, once with the exact indexer and
once per FP8 option, with the indexer's selection replaced by the math of `k3c.codegen.triton.dsa_decode`:
  fp8 keys        k = scale * k8 (e4m3, one fp32 scale per key, `quantize_index_keys`); q exact
  fp8 keys + q    q also e4m3 per head (FP8_QUERY: the scan's fp8 x fp8 product)
  + rerank N      the topk + N best fp8 scores re-ranked by their exact scores (`k_exact`)
Every decode step's fp8 selection is also run through the Triton kernel (`dsa_decode_topk`, interpreter) and must
equal this script's torch selection (KERNEL line). Errors per call: max |a - b| / max |b| over the vocabulary
(worst call), and how often the greedy token agrees. Usage:
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dsa_fp8_logits.py [--prompt 64] [--steps 32] [--seed 1]
"""

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton import dsa_decode as dd  # noqa: E402
from models import layers  # noqa: E402
from models.k3 import K3Config, K3ForCausalLM  # noqa: E402
from models.ops import dsa_scores  # noqa: E402


def fp8_per_row(x):
    """x ~= scale * x8, e4m3 with one scale per row of the last dim (as `quantize_index_keys`)."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / dd.FP8_MAX, torch.ones_like(amax))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def select(scores, exact, topk, extra):
    """Causal top-k by `scores` (fp8); with extra: the topk + extra best re-ranked by `exact`. [B,T,L] -> [B,T,topk]."""
    L = scores.shape[-1]
    if extra is not None:
        cand = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk + extra]
        keep = torch.full_like(exact, float("-inf")).scatter(-1, cand, exact.gather(-1, cand))
        scores = torch.where(torch.isfinite(scores), keep, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    idx = torch.where(torch.isfinite(scores.gather(-1, order)), order, -1)
    return torch.nn.functional.pad(idx, (0, max(0, topk - L)), value=-1)


class Fp8Indexer:
    """Replacement for `layers.Indexer.forward` with the chosen FP8 option; counts kernel agreement at decode."""

    def __init__(self, query_fp8, extra):
        self.query_fp8, self.extra, self.kernel_steps, self.kernel_equal = query_fp8, extra, 0, 0

    def __call__(self, mod, x, qr, cache, new_cache, prefix):
        B, T, _ = x.shape
        keys = torch.cat([cache[prefix + "index_k"], mod.k_norm(mod.wk(x))], 1)
        new_cache[prefix + "index_k"] = keys
        q_idx = mod.wq_b(qr).reshape(B, T, mod.J, mod.Dk)
        w = mod.weights_proj(x) * (mod.J ** -0.5 * mod.Dk ** -0.5)
        q8 = fp8_per_row(q_idx) if self.query_fp8 else q_idx
        idx = select(dsa_scores(q8, w, fp8_per_row(keys)), dsa_scores(q_idx, w, keys), mod.topk, self.extra)
        if T == 1 and self.query_fp8:      # the kernel computes exactly this option (fp8 q, FP8_QUERY)
            k8, ks = dd.quantize_index_keys(keys)
            k_exact = keys if self.extra is not None else None
            got = dd.dsa_decode_topk(q_idx[:, 0], w[:, 0], k8, mod.topk, k_scale=ks, ordered=True, k_exact=k_exact,
                                     rerank_extra=self.extra or 0)
            self.kernel_steps += 1
            self.kernel_equal += int(torch.equal(got, idx))
        return idx


def run(model, tokens, prompt):
    """Logits of the prefill's last position and of every teacher-forced decode step: [calls, B, vocab]."""
    logits, cache = model(tokens[:, :prompt])
    out = [logits[:, -1]]
    for t in range(prompt, tokens.shape[1]):
        logits, cache = model(tokens[:, t:t + 1], cache)
        out.append(logits[:, -1])
    return torch.stack(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(K3Config.from_pretrained("k3.1-pro-tiny")).init_random_(args.seed).eval()
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt))
    with torch.no_grad():                               # greedy continuation of the exact model
        logits, cache = model(tokens)
        for _ in range(args.steps):
            nxt = logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, nxt], 1)
            logits, cache = model(nxt, cache)
        exact = run(model, tokens, args.prompt)
        print(f"k3.1-pro-tiny seed {args.seed}: batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, "
              f"index top-{cfg.index_topk} of up to {tokens.shape[1]} keys, {cfg.index_num_heads} x "
              f"{cfg.index_head_dim} index heads")
        original = layers.Indexer.forward
        for name, query_fp8, extra in (("fp8 keys", False, None), ("fp8 keys + fp8 q", True, None),
                                       ("fp8 keys + fp8 q + rerank 4", True, 4),
                                       ("fp8 keys + fp8 q + rerank 16", True, 16)):
            hook = Fp8Indexer(query_fp8, extra)
            layers.Indexer.forward = lambda mod, *a, hook=hook: hook(mod, *a)
            try:
                got = run(model, tokens, args.prompt)
            finally:
                layers.Indexer.forward = original
            err = ((got - exact).abs().amax(-1) / exact.abs().amax(-1)).max().item()
            agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
            print(f"ROW {name}: max rel logits error {err:.3e}, greedy agreement {100 * agree:.1f} %")
            if hook.kernel_steps:
                print(f"KERNEL {name}: dsa_decode_topk == torch selection in {hook.kernel_equal} / "
                      f"{hook.kernel_steps} decode calls")


if __name__ == "__main__":
    main()
