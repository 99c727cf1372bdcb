"""Inputs, reference checks and configuration knobs of `bench_kda.py` (Kimi K3 KDA shapes: H = 96 heads, D = 128,
conv width 4): random activations / weights / states (`make`), the relative L2 error, the check of every timed k3c
variant against `kda_fused_reference` before it is timed (`check_gpu`, CHECK lines), the bf16-state drift over many
decode steps, and the context managers that set k3c.codegen.triton.kda's module constants for a sweep."""

import itertools

import torch

from k3c.codegen.triton import kda as kda_module
from k3c.codegen.triton.kda import kda_decode, kda_fused_reference, kda_prefill

H, D, W = 96, 128, 4
HD = H * D


def make(B, T, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)

    def r(*s, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dtype)

    acts = dict(q_in=r(B, T, HD), k_in=r(B, T, HD), v_in=r(B, T, HD), f=r(B, T, HD, scale=0.5),
                beta_logits=r(B, T, H), gate_logits=r(B, T, HD))
    f32 = torch.float32
    weights = dict(conv_w_q=r(HD, W, scale=0.5, dtype=f32), conv_w_k=r(HD, W, scale=0.5, dtype=f32),
                   conv_w_v=r(HD, W, scale=0.5, dtype=f32), A_log=r(H, scale=0.5, dtype=f32),
                   dt_bias=r(HD, scale=0.3, dtype=f32), o_norm_weight=1 + r(D, scale=0.1, dtype=f32))
    state = dict(state=r(B, H, D, D, scale=0.05, dtype=f32), conv_state=r(B, 3 * HD, W, dtype=f32))
    return acts, weights, state


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def small_heads(acts, weights, state, n_heads):
    """The first n_heads heads of full-width inputs (a cheap reference at K3's D)."""
    hd = n_heads * D
    B = state["state"].shape[0]
    a = {k: v[..., :n_heads] if k == "beta_logits" else v[..., :hd] for k, v in acts.items()}
    w = {k: (v[:hd] if v.shape[0] == HD else v[:n_heads] if k == "A_log" else v) for k, v in weights.items()}
    st = dict(state=state["state"][:, :n_heads].contiguous(),
              conv_state=state["conv_state"].view(B, 3, HD, W)[:, :, :hd].reshape(B, 3 * hd, W).contiguous())
    return a, w, st


def check(results, name, y, y_ref, st, S_ref, C_ref, tol):
    r = dict(check=name, y_rel=rel_err(y, y_ref), state_rel=rel_err(st["state"], S_ref),
             conv_rel=rel_err(st["conv_state"], C_ref))
    r["ok"] = max(r["y_rel"], r["state_rel"], r["conv_rel"]) <= tol
    results.append(r)
    print("CHECK", r, flush=True)


def check_gpu(dev, results, decode_cfgs, chunk_cfgs, conv_dtypes=(torch.float32,)):
    """bf16-input correctness of every timed k3c variant vs the fp32 reference (relative L2 error); decode with
    each conv-state dtype of `conv_dtypes` (bf16 holds the bf16 inputs exactly: same tolerance)."""
    acts, weights, state = small_heads(*make(2, 300, dev, seed=1), 8)
    y_ref, S_ref, C_ref = kda_fused_reference(**acts, **weights, **state)
    st = {k: v.clone() for k, v in state.items()}
    y = kda_prefill(**acts, **weights, **st, method="recurrent")
    check(results, "prefill recurrent T=300 H=8", y, y_ref, st, S_ref, C_ref, 1e-3)
    for bv, _, pw, chunk, *front in sorted({(bv, 0, *rest) for bv, _, *rest in chunk_cfgs}):
        with prep_config(pw, chunk, *front):
            name = f"chunk {chunk} block_v={bv} prep {pw} warps, front {front[0]} tokens x {front[1]} warps"
            runs = fits(lambda: kda_prefill(**acts, **weights, **{k: v.clone() for k, v in state.items()},
                                            method="chunk", block_v=bv, store_output=False))
            for lens in (None, [300, 173]) if runs else ():
                st = {k: v.clone() for k, v in state.items()}
                y = kda_prefill(**acts, **weights, **st, method="chunk", block_v=bv, lengths=lens)
                if lens is None:
                    check(results, f"prefill {name} T=300 H=8", y, y_ref, st, S_ref, C_ref, 1e-2)
                else:       # row 1 stops at 173 tokens
                    r1 = kda_fused_reference(**{k: v[1:, :173] for k, v in acts.items()}, **weights,
                                             **{k: v[1:] for k, v in state.items()})
                    check(results, f"prefill {name} lengths (300, 173), row 1", y[1:, :173], r1[0],
                          {k: v[1:] for k, v in st.items()}, r1[1], r1[2], 1e-2)
    for sdt, cfgs in decode_cfgs.items():
        for (bv, variant, fw), cdt in itertools.product(sorted({(bv, v, fw) for bv, _, v, fw in cfgs}), conv_dtypes):
            st = {k: v.clone() for k, v in state.items()}
            kda_prefill(**{k: v[:, :296] for k, v in acts.items()}, **weights, **st, method="recurrent")
            st["state"], st["conv_state"] = st["state"].to(sdt), st["conv_state"].to(cdt)
            with module_consts(DECODE_FRONT_WARPS=fw or kda_module.DECODE_FRONT_WARPS):
                ys = [kda_decode(**{k: v[:, t] for k, v in acts.items()}, **weights, **st, block_v=bv or None,
                                 variant=VARIANTS[variant]) for t in range(296, 300)]
            st["state"] = st["state"].float()
            check(results, f"decode x4 {cfg_name(bv, 0, variant, fw)} state {str(sdt)[6:]} conv state "
                  f"{str(cdt)[6:]} after prefill", torch.stack(ys, 1), y_ref[:, 296:], st, S_ref, C_ref,
                  1e-2 if sdt == torch.bfloat16 else 1e-3)
    # row-strided activations (the column views of one fused projection output) give the contiguous results
    views = fused_views({k: v[:, 296:297] for k, v in acts.items()})
    for variant in ("fused", "front"):
        outs = []
        for a in (views, {k: v.contiguous() for k, v in views.items()}):
            st = {k: v.clone() for k, v in state.items()}
            outs.append((kda_decode(**{k: v[:, 0] for k, v in a.items()}, **weights, **st, variant=variant), st))
        r = dict(check=f"decode {variant}, row-strided activations vs contiguous (bitwise)",
                 y_rel=rel_err(outs[0][0], outs[1][0]), state_rel=rel_err(outs[0][1]["state"], outs[1][1]["state"]),
                 conv_rel=rel_err(outs[0][1]["conv_state"], outs[1][1]["conv_state"]))
        r["ok"] = r["y_rel"] == r["state_rel"] == r["conv_rel"] == 0.0
        results.append(r)
        print("CHECK", r, flush=True)


def fits(fn):
    """Whether fn runs (False, printed, when Triton finds the configuration out of resources or cannot build it)."""
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001  OutOfResources, a compile error: the other configurations still run
        print(f"# skipped: {e!r}", flush=True)
        return False


def fused_views(acts):
    """The activations as column views of one [B, T, N] buffer (`fuse_gemms`' split of one GEMM output)."""
    order = ("q_in", "k_in", "v_in", "f", "beta_logits", "gate_logits")
    buf = torch.cat([acts[k] for k in order], -1)
    return dict(zip(order, torch.split(buf, [acts[k].shape[-1] for k in order], -1)))


class module_consts:
    """Context manager: set module constants of k3c.codegen.triton.kda by name, restored on exit."""

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        self.saved = {n: getattr(kda_module, n) for n in self.values}
        for n, v in self.values.items():
            setattr(kda_module, n, v)

    def __exit__(self, *exc):
        for n, v in self.saved.items():
            setattr(kda_module, n, v)


def prep_config(prep_warps, chunk, front_tokens, front_warps):
    """The chunked prefill's module constants (prep warps, chunk size, front-kernel tokens and warps per program)
    for a block."""
    return module_consts(CHUNK_PREP_WARPS=prep_warps, CHUNK=chunk, CHUNK_FRONT_TOKENS=front_tokens,
                         CHUNK_FRONT_WARPS=front_warps)


def bf16_state_drift(dev, results, steps=4096):
    """bf16 vs fp32 decode state over `steps` decode steps at B = 1, H = 96 (same inputs), two gate regimes."""
    for regime, f_shift in (("random gates (mean g = -2.5)", 0.0), ("slow decay (g ~ -0.002)", -8.0)):
        _, weights, state = make(1, 1, dev, seed=5)
        weights["dt_bias"].zero_()
        weights["A_log"].zero_()                            # a = 1: g = -5 sigmoid(f)
        s32 = {k: v.clone() for k, v in state.items()}
        s16 = dict(state=state["state"].to(torch.bfloat16), conv_state=state["conv_state"].clone())
        worst, y_last = 0.0, None
        for t in range(steps):
            acts = {k: v[:, 0] for k, v in make(1, 1, dev, seed=1000 + t)[0].items()}
            acts["f"] = acts["f"] + f_shift
            y32 = kda_decode(**acts, **weights, **s32)
            y16 = kda_decode(**acts, **weights, **s16)
            e = rel_err(y16, y32)
            worst = max(worst, e)
            y_last = e
        r = dict(check=f"bf16 state vs fp32 state, {steps} decode steps, {regime}", y_rel=worst,
                 state_rel=rel_err(s16["state"], s32["state"]),
                 conv_rel=rel_err(s16["conv_state"], s32["conv_state"]), y_rel_last=y_last, ok=True)
        results.append(r)
        print("CHECK", r, flush=True)


# decode variant codes of --decode / --decode-bf16 (kda.DECODE_VARIANTS; 0: the launcher's choice)
VARIANTS = {0: None, 1: "fused", 2: "front", 3: "front_serial"}


def cfg_name(bv, nw, variant=0, front_warps=0):
    split = f"block_v={bv}, num_warps={nw}" if bv else "default split (kda.decode_split)"
    form = {0: "default form", 1: "one launch", 2: "front kernel + state kernel (PDL)",
            3: "front kernel + state kernel (no PDL)"}[variant]
    return f"{form}, {split}" + (f", front {front_warps} warps" if front_warps else "")
