"""What limits the top-k overlap of FP8 (e4m3) DSA index keys, measured in torch on given index inputs.

The option (`--dsa-index-keys fp8`, `dsa_index_topk_ref` in k3c/ir/ops/model_attn.py): keys e4m3 with one f32 scale
per key (max|k| / 448), q rounded to bf16 then e4m3 per head (its scale folded into w). E4m3 keeps 3 mantissa bits:
a value's relative rounding error is up to 2^-4, so each score carries noise, and a key whose exact score lies
within about that noise of the top-k threshold can cross it. `study` measures, per variant, the overlap of the
top-k set with the exact one (fp32 scores of the bf16 inputs), the score noise (RMS of fp8 score - exact score over
the exact top-2k keys, around the threshold) against the score spread there, and how many keys lie within one
noise RMS of the threshold; variants:
  - "option": the compiled option above;
  - "exact q": e4m3 keys (per-key scale), q exact (the keys' share of the noise);
  - "32-channel key scales": one scale per 32 channels of a key (+12 B per key at D = 128), e4m3 q per head;
  - "Hadamard": q and k rotated by the normalized D x D Walsh-Hadamard matrix before quantizing (q.k unchanged; as
    DeepSeek-V3.2's indexer), then as the option;
  - "int8": the same bytes as the option, but q and k as int8 with one scale per head / key (max|x| / 127, round to
    nearest): a uniform grid, 7 bits below each row's largest value instead of e4m3's 3 mantissa bits;
  - "Hadamard + int8": rotated as "Hadamard", then as "int8".
`outlier_keys` makes keys with a few large channels (as real activations have, unlike the bench's Gaussian keys,
which any rotation leaves Gaussian), where a rotation is expected to matter.

Run on its own (CPU, small): python benchmarks/dsa_fp8_overlap.py [--rows 2] [--keys 131072]
"""

import argparse
import math

import torch

FP8_MAX = 448.0


def hadamard(d, device):
    """The normalized Sylvester Walsh-Hadamard matrix [d, d] f32 (d a power of 2): orthogonal and symmetric."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def quantize(x, group):
    """x [..., D] f32 -> e4m3 values as f32 times their scales (max|x| / 448 per `group` channels; 1 for zeros)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def quantize_int8(x):
    """x [..., D] f32 -> int8 values as f32 times their scales (max|x| / 127 per row; 1 for zeros)."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scale).clamp(-127, 127) * scale


def scores(q, w, k):
    """I[b, s] = sum_j w[b, j] ReLU(q[b, j] . k[b, s]) in f32: q [B, J, D], w [B, J], k [B, L, D]."""
    return torch.einsum("bj,bjs->bs", w, torch.einsum("bjd,bsd->bjs", q, k).relu())


def variant_scores(name, q_i, w, k_i):
    """Scores of variant `name` (module docstring) for bf16 q_i [B, J, D], w [B, J], k_i [B, L, D]."""
    q, k, w = q_i.float(), k_i.float(), w.float()
    D = q.shape[-1]
    if name.startswith("Hadamard"):
        hm = hadamard(D, q.device)
        q, k = q @ hm, k @ hm
        q = q.to(torch.bfloat16).float()
    if name.endswith("int8"):
        return scores(quantize_int8(q), w, quantize_int8(k))
    q8 = quantize(q, D)
    if name == "exact q":
        return scores(q, w, quantize(k, D))
    return scores(q8, w, quantize(k, 32 if name == "32-channel key scales" else D))


def outlier_keys(k_i, channels=4, factor=16.0):
    """k_i with `channels` fixed channels scaled by `factor` (bf16): keys with outlier channels."""
    k = k_i.float().clone()
    k[..., :channels] *= factor
    return k.to(k_i.dtype)


def study(q_i, w, k_i, topk, variants=("option", "exact q", "32-channel key scales", "Hadamard", "int8",
                                        "Hadamard + int8")):
    """Per variant (module docstring): overlap (min and mean over rows), score noise RMS and the exact scores' spread
    around the threshold (std over the exact top-2k), keys within one noise RMS of the threshold per row (mean),
    threshold / noise. Inputs as `variant_scores`; returns a dict of dicts of floats."""
    exact = scores(q_i.float(), w.float(), k_i.float())
    top = exact.topk(2 * topk, dim=-1)
    tau = top.values[:, topk - 1:topk]                                  # the exact threshold per row
    want = top.indices[:, :topk]
    out = {}
    for name in variants:
        s = variant_scores(name, q_i, w, k_i)
        got = s.topk(topk, dim=-1).indices
        ov = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / topk for a, b in zip(got, want)])
        noise = (s.gather(1, top.indices) - top.values).pow(2).mean(1).sqrt()        # [B]
        near = ((exact - tau).abs() < noise[:, None]).sum(1).float()
        out[name] = dict(overlap_min=ov.min().item(), overlap_mean=ov.mean().item(),
                         noise_rms=noise.mean().item(), spread_top2k=top.values.std(1).mean().item(),
                         keys_within_noise_of_threshold=near.mean().item(),
                         threshold_over_noise=(tau[:, 0] / noise).mean().item())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--keys", type=int, default=131072)
    ap.add_argument("--topk", type=int, default=2048)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q_i = torch.randn(args.rows, 32, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(args.rows, 32, generator=g) * 32 ** -0.5
    k_i = torch.randn(args.rows, args.keys, 128, generator=g).to(torch.bfloat16)
    for label, k in (("Gaussian keys", k_i), ("keys with 4 outlier channels x16", outlier_keys(k_i))):
        for name, r in study(q_i, w, k, args.topk).items():
            print(f"{label} | {name} | " + ", ".join(f"{a} {b:.4g}" for a, b in r.items()), flush=True)


if __name__ == "__main__":
    main()
