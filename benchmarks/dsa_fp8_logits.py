"""End-to-end logits error of FP8 DSA index keys on k3.1-pro-tiny (CPU, fp32 model, random weights).

Runs the reference model (models/k3.py) on a prompt and teacher-forced decode steps, once with the exact indexer and
once per FP8 option, with the indexer's selection replaced by the math of `k3c.codegen.triton.dsa_decode`:
  fp8 keys        k = scale * k8 (e4m3, one fp32 scale per key, `quantize_index_keys`); q exact
  fp8 keys + q    q also e4m3 per head (FP8_QUERY: the scan's fp8 x fp8 product)
  k3c fp8         `k3c compile --dsa-index-keys fp8`: the IR ops' semantics (`fp8_quantize`, `dsa_index_topk` with
                  k_scale: q rounded to bf16, then e4m3 per head), no exact keys kept
  k3c fp8-rerank E  `--dsa-index-keys fp8-rerank` (`fp8_split`, `dsa_index_topk` with k_lo, rerank E): the topk + E
                  best by the e4m3 scan re-ranked by their joined keys (e4m3 + 4-bit residual) with the exact q; E =
                  4, 16 and the option's DSA_RERANK_EXTRA (every key a candidate in the tiny model)
  compiled        (--artifact) the compiled artifacts themselves: k3.1-pro-tiny compiled plan-only with
                  --dsa-index-keys fp8 and fp8-rerank, their prefill / decode graphs (every pass run) interpreted
                  with the model's weights
Every decode step's fp8 and fp8-rerank selection is also run through the Triton kernels (`dsa_decode_topk`,
interpreter) and must equal this script's torch selection (KERNEL line). Errors per call: max |a - b| / max |b| over the vocabulary
(worst call), how often the greedy token agrees, and the mean overlap of each selection with the exact indexer's
(rows with more visible keys than topk). --scale L adds the overlap at full size (K3.1 Pro's indexer: 32 heads of
128, top-2048 of L Gaussian keys, LayerNorm'd; Gaussian queries and head weights), where rounding moves more keys
across the threshold than in the tiny model. Usage:
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dsa_fp8_logits.py [--prompt 64] [--steps 32] [--seed 1]
        [--artifact] [--scale 131072]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from k3c.codegen.triton import dsa_decode as dd  # noqa: E402
from k3c.context import DSA_RERANK_EXTRA  # noqa: E402
from k3c.ir.ops.model_attn import dsa_index_topk_ref, fp8_quantize_ref, fp8_split_ref  # noqa: E402
from models import layers  # noqa: E402
from models.k3 import K3Config, K3ForCausalLM  # noqa: E402
from models.ops import dsa_scores  # noqa: E402


def fp8_per_row(x):
    """x ~= scale * x8, e4m3 with one scale per row of the last dim (as `quantize_index_keys`)."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / dd.FP8_MAX, torch.ones_like(amax))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def select(scores, topk):
    """Causal top-k by `scores`. [B,T,L] -> [B,T,topk]."""
    L = scores.shape[-1]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    idx = torch.where(torch.isfinite(scores.gather(-1, order)), order, -1)
    return torch.nn.functional.pad(idx, (0, max(0, topk - L)), value=-1)


def overlap(idx, exact):
    """(sum over rows of |idx ∩ exact| / |exact|, rows) over the rows whose exact set is full (no -1 slot)."""
    full = (exact >= 0).all(-1)
    hit = (idx[..., :, None] == exact[..., None, :]).any(-1).sum(-1).float() / exact.shape[-1]
    return float(hit[full].sum()), int(full.sum())


class Fp8Indexer:
    """Replacement for `layers.Indexer.forward` with the chosen FP8 option ("k3c": the IR ops' semantics, with
    extra: fp8-rerank's); counts kernel agreement at decode and the overlap with the exact selection."""

    def __init__(self, query_fp8, extra):
        self.query_fp8, self.extra, self.kernel_steps, self.kernel_equal = query_fp8, extra, 0, 0
        self.hits, self.rows = 0.0, 0

    def __call__(self, mod, x, qr, cache, new_cache, prefix):
        B, T, _ = x.shape
        keys = torch.cat([cache[prefix + "index_k"], mod.k_norm(mod.wk(x))], 1)
        new_cache[prefix + "index_k"] = keys
        q_idx = mod.wq_b(qr).reshape(B, T, mod.J, mod.Dk)
        w = mod.weights_proj(x) * (mod.J ** -0.5 * mod.Dk ** -0.5)
        exact = select(dsa_scores(q_idx, w, keys), mod.topk)
        if self.query_fp8 == "k3c" and self.extra is not None:
            (idx,) = dsa_index_topk_ref({"topk": mod.topk, "rerank": self.extra}, q_idx, w, *fp8_split_ref({}, keys))
        elif self.query_fp8 == "k3c":
            (idx,) = dsa_index_topk_ref({"topk": mod.topk}, q_idx, w, *fp8_quantize_ref({}, keys))
        else:
            q8 = fp8_per_row(q_idx) if self.query_fp8 else q_idx
            idx = select(dsa_scores(q8, w, fp8_per_row(keys)), mod.topk)
        hits, rows = overlap(idx, exact)
        self.hits, self.rows = self.hits + hits, self.rows + rows
        if T == 1 and self.query_fp8 is True:      # the kernel computes exactly this option (fp8 q, FP8_QUERY)
            k8, ks = dd.quantize_index_keys(keys)
            got = dd.dsa_decode_topk(q_idx[:, 0], w[:, 0], k8, mod.topk, k_scale=ks, ordered=True)
        elif T == 1 and self.extra is not None:     # fp8-rerank: the scan, the selection and the re-rank kernels
            k8, ks, lo = fp8_split_ref({}, keys)
            got = dd.dsa_decode_topk(q_idx[:, 0], w[:, 0], k8, mod.topk, k_scale=ks, ordered=True, k_lo=lo,
                                     rerank_extra=self.extra)
        if T == 1 and (self.query_fp8 is True or self.extra is not None):
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


def run_artifact(model, tokens, prompt, keys):
    """`run` on the compiled artifact's graphs: k3.1-pro-tiny compiled plan-only (f32) with --dsa-index-keys `keys`,
    its prefill and decode graphs interpreted with `model`'s weights, the caches carried between calls."""
    from k3c.compile import CompileOptions, compile_model
    from k3c.ir import serialize
    from k3c.ir.interp import interpret
    from k3c.ir.types import evaluate, torch_dtype
    from k3c.passes.derived import materialize_params

    B, n = tokens.shape
    with tempfile.TemporaryDirectory() as tmp:
        opts = CompileOptions(model.config.name, Path(tmp) / "art", target="h200", dtype="f32", max_batch=B,
                              max_seq=n, max_prefill=prompt, plan_only=True, dsa_index_keys=keys)
        compile_model(opts)
        graphs = {e: serialize.load(opts.out / "graph" / f"{e}.json") for e in ("prefill", "decode")}
    named = {k: p.detach() for k, p in model.named_parameters()}
    params = {e: materialize_params(g, named) for e, g in graphs.items()}
    caches = {v.name: torch.zeros([evaluate(d, {"B": B, "L": 0}) for d in v.type.shape],
                                  dtype=torch_dtype(v.type.dtype)) for v in graphs["prefill"].inputs if v.name != "tokens"}
    out = []
    for t0, t1 in [(0, prompt)] + [(t, t + 1) for t in range(prompt, n)]:
        entry = "prefill" if t0 == 0 else "decode"
        res = interpret(graphs[entry], {"tokens": tokens[:, t0:t1], **caches}, params[entry],
                        bindings={"B": B, "T": t1 - t0, "L": t0})
        caches = {k: res[k] for k in caches}
        out.append(res["logits"][:, -1])
    return torch.stack(out)


def overlap_at_scale(L, rows=4, J=32, D=128, topk=2048, seed=0):
    """Mean overlap with the exact top-k of: the k3c fp8 semantics, fp8 keys with an exact q, and the k3c fp8-rerank
    semantics (E = DSA_RERANK_EXTRA); `rows` decode queries over L keys (f32 LayerNorm'd Gaussian keys: the
    residuals' 4 bits join them to bf16 precision, not exactly)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.layer_norm(torch.randn(1, L, D, generator=gen), (D,))
    k8, ks = fp8_quantize_ref({}, keys)
    split = fp8_split_ref({}, keys)
    rerank = f"k3c fp8-rerank E = {DSA_RERANK_EXTRA}"
    res = {"k3c fp8 (e4m3 q and keys)": 0.0, "fp8 keys, exact q": 0.0, rerank: 0.0}
    for _ in range(rows):
        q = torch.randn(1, 1, J, D, generator=gen)
        w = torch.randn(1, 1, J, generator=gen) * (J ** -0.5 * D ** -0.5)
        exact_s = dsa_scores(q, w, keys)
        exact = select(exact_s, topk)
        (fp8,) = dsa_index_topk_ref({"topk": topk}, q, w, k8, ks)
        fp8_s = dsa_scores(q, w, k8.float() * ks[..., None])
        res["k3c fp8 (e4m3 q and keys)"] += overlap(fp8, exact)[0] / rows
        res["fp8 keys, exact q"] += overlap(select(fp8_s, topk), exact)[0] / rows
        (rr,) = dsa_index_topk_ref({"topk": topk, "rerank": DSA_RERANK_EXTRA}, q, w, *split)
        res[rerank] += overlap(rr, exact)[0] / rows
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--artifact", action="store_true", help="also run the compiled --dsa-index-keys fp8 and "
                    "fp8-rerank artifacts")
    ap.add_argument("--scale", type=int, default=0, help="also the overlap at full size over this many keys")
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
                                       ("k3c fp8", "k3c", None), ("k3c fp8-rerank E = 4", "k3c", 4),
                                       ("k3c fp8-rerank E = 16", "k3c", 16),
                                       (f"k3c fp8-rerank E = {DSA_RERANK_EXTRA}", "k3c", DSA_RERANK_EXTRA)):
            hook = Fp8Indexer(query_fp8, extra)
            layers.Indexer.forward = lambda mod, *a, hook=hook: hook(mod, *a)
            try:
                got = run(model, tokens, args.prompt)
            finally:
                layers.Indexer.forward = original
            err = ((got - exact).abs().amax(-1) / exact.abs().amax(-1)).max().item()
            agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
            print(f"ROW {name}: max rel logits error {err:.3e}, greedy agreement {100 * agree:.1f} %, top-k overlap "
                  f"with the exact indexer {hook.hits / max(hook.rows, 1):.4f} ({hook.rows} rows)")
            if hook.kernel_steps:
                print(f"KERNEL {name}: dsa_decode_topk == torch selection in {hook.kernel_equal} / "
                      f"{hook.kernel_steps} decode calls")
        for keys in ("fp8", "fp8-rerank") if args.artifact else ():
            got = run_artifact(model, tokens, args.prompt, keys)
            err = ((got - exact).abs().amax(-1) / exact.abs().amax(-1)).max().item()
            agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
            print(f"ROW compiled --dsa-index-keys {keys}: max rel logits error {err:.3e}, greedy agreement "
                  f"{100 * agree:.1f} %")
    if args.scale:
        for name, v in overlap_at_scale(args.scale).items():
            print(f"SCALE L={args.scale} top-2048: {name}: overlap with the exact indexer {v:.4f}")


if __name__ == "__main__":
    main()
