"""Benchmark and GPU check of the fused KDA kernels (k3c.codegen.triton.kda) against FLA, torch eager and
torch.compile, at Kimi K3 shapes (H = 96 heads, D = 128), bf16 activations, fp32 (or bf16) state.

Run on a CUDA machine (fla-core optional: its rows are skipped when it is missing):
    python benchmarks/bench_kda.py [--out DIR] [--no-compile] [--prefill-T 1024,8192,32768]
Every k3c variant is checked against the reference in the same run before it is timed (CHECK lines). Prints one
table (time, GB/s and fraction of the 4.2 TB/s HBM roofline; TFLOP/s vs 790 for prefill) and writes kda_bench.json /
kda_bench.md under --out. Timing: triton.testing.do_bench_cudagraph (median of graph replays; each replay runs the
op once per buffer set, rotating through enough sets to exceed the 60 MB L2), falling back to do_bench (median)
where graph capture fails; that column says which. Per-kernel times of the multi-kernel paths come from
torch.profiler (PROFILE lines).
Bytes per decode step = state read + write (fp32 or bf16) + conv state read + write (fp32 or bf16) + activations
in (bf16) + y out (bf16) + per-layer weights. Prefill FLOP = B*T*H*(6*D^2 + 10*64*D): the chunk algorithm's matrix
products at chunk 64 (three state products, five intra-chunk products), the same count for every implementation.
"""

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from k3c.codegen.triton import kda as kda_module  # noqa: E402
from k3c.codegen.triton.kda import kda_decode, kda_prefill, kda_spec_replay  # noqa: E402
from kda_checks import (D, H, HD, VARIANTS, W, bf16_state_drift, cfg_name, check_gpu, fused_views,  # noqa: E402
                        make, module_consts, prep_config, rel_err)

HBM_BYTES_PER_S = 4.2e12       # measured device copy bandwidth (KINDS.md: ~4.3 TB/s)
BF16_FLOP_PER_S = 790e12       # measured bf16 matrix rate (KINDS.md)
L2_BYTES = 60e6


def eager_decode_step(q_in, k_in, v_in, f, beta_logits, gate_logits, conv_w_q, conv_w_k, conv_w_v, A_log, dt_bias,
                      o_norm_weight, state, conv_state, lower_bound=-5.0, eps=1e-5):
    """Plain torch decode step (activations [B, H*D]); the body torch.compile gets. Updates the states in place."""
    B = q_in.shape[0]
    x = torch.cat([q_in, k_in, v_in], -1).float()
    window = torch.cat([conv_state[..., 1:], x[..., None]], -1)
    conv_state.copy_(window)
    qkv = F.silu((window * torch.cat([conv_w_q, conv_w_k, conv_w_v], 0)).sum(-1))
    q, k, v = (c.reshape(B, H, D) for c in qkv.split(HD, -1))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = lower_bound * torch.sigmoid(A_log[:H].exp()[:, None] * (f.float().view(B, H, D) + dt_bias.view(H, D)))
    beta = torch.sigmoid(beta_logits.float()).view(B, H, 1)
    S = g.exp()[..., None] * state
    u = beta * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., None] * u[:, :, None, :]
    state.copy_(S)
    o = torch.einsum("bhkv,bhk->bhv", S, q)
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * o_norm_weight
    return (o * torch.sigmoid(gate_logits.float().view(B, H, D))).reshape(B, HD).to(q_in.dtype)


def bench(fn_per_set, n_sets):
    """Median ms per op: graph replay of one call per buffer set (divided by n_sets); do_bench as fallback."""
    def run_all():
        for i in range(n_sets):
            fn_per_set(i)
    run_all()
    torch.cuda.synchronize()
    try:
        ms = triton.testing.do_bench_cudagraph(run_all, rep=200, return_mode="median")
        return ms / n_sets, "graph"
    except Exception:  # capture not possible (host syncs): plain launches
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run_all, warmup=25, rep=200, return_mode="median")
        return ms / n_sets, "launch"


def fla_available():
    try:
        import fla.ops.kda  # noqa: F401
        return True
    except Exception as e:  # noqa: BLE001
        print(f"# fla unavailable: {e!r}")
        return False


def profile_kernels(label, fn):
    """Per-kernel CUDA times of fn (5 calls), from torch.profiler, printed as PROFILE lines."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    for key in ("self_cuda_time_total", "self_device_time_total"):
        try:
            table = prof.key_averages().table(sort_by=key, row_limit=8)
            break
        except Exception:  # noqa: BLE001  the sort key's name differs across torch versions
            table = str(prof.key_averages())
    for line in table.splitlines():
        print(f"PROFILE {label} | {line}", flush=True)


def decode_rows(dev, have_fla, rows, decode_cfgs, do_compile, batches=(1, 16, 64), lean=False, profile=False,
                conv_dtypes=(torch.float32,)):
    """Decode rows at each batch: the split configurations (decode_cfgs: block_v, num_warps, VARIANTS code, front
    warps) with each conv-state dtype of `conv_dtypes` and, unless `lean`, the strided-input, token-loop, torch
    eager / compile and FLA rows (fp32 conv state); `profile`: the per-kernel times of the two-phase default."""
    for B in batches:
        state_bytes = B * H * D * D * 4 * 2 + B * 3 * HD * W * 4 * 2
        io_bytes = B * (5 * HD + H) * 2 + B * HD * 2 + (3 * HD * W + HD + D + H) * 4
        n_sets = max(1, math.ceil(3 * L2_BYTES / state_bytes))
        sets = [make(B, 1, dev, seed=10 + i) for i in range(n_sets)]
        step = [({k: v[:, 0] for k, v in a.items()}, w, s) for a, w, s in sets]

        def add(name, ms, how, nbytes=state_bytes + io_bytes):
            rows.append(dict(kind="decode", B=B, T=1, impl=name, ms=ms, how=how, GBps=nbytes / ms / 1e6,
                             roofline=nbytes / ms / 1e-3 / HBM_BYTES_PER_S))
            print("ROW", rows[-1], flush=True)

        for sdt, cdt in itertools.product((torch.float32, torch.bfloat16), conv_dtypes):
            states = [dict(state=s["state"].to(sdt), conv_state=s["conv_state"].to(cdt)) for _, _, s in step]
            nbytes = B * H * D * D * 2 * sdt.itemsize + B * 3 * HD * W * 2 * cdt.itemsize + io_bytes
            label = ("bf16 state, " if sdt == torch.bfloat16 else "") + \
                ("bf16 conv state, " if cdt == torch.bfloat16 else "")
            for bv, nw, variant, fw in decode_cfgs[sdt]:
                def call(i, bv=bv, nw=nw, variant=variant, states=states):
                    kda_decode(**step[i][0], **step[i][1], **states[i], block_v=bv or None, num_warps=nw or None,
                               variant=VARIANTS[variant])
                with module_consts(DECODE_FRONT_WARPS=fw or kda_module.DECODE_FRONT_WARPS):
                    try:
                        ms, how = bench(call, n_sets)
                    except Exception as e:  # noqa: BLE001  keep the other rows
                        print(f"# decode {label}{cfg_name(bv, nw, variant, fw)} B={B} failed: {e!r}", flush=True)
                        continue
                    add(f"k3c decode, {label}split V ({cfg_name(bv, nw, variant, fw)})", ms, how, nbytes)
                    if variant in (2, 3) and not (bv or nw or fw):   # stream launches: the overlap without graphs
                        ms = triton.testing.do_bench(lambda: [call(i) for i in range(n_sets)], warmup=25, rep=100,
                                                     return_mode="median") / n_sets
                        add(f"k3c decode, {label}split V ({cfg_name(bv, nw, variant, fw)})", ms, "launch", nbytes)
                    if profile and variant == 2 and not (bv or nw or fw):
                        profile_kernels(f"decode B={B} {label}front + state", lambda: call(0))
            del states
        if lean:
            del sets, step
            continue
        strided = [fused_views({k: v[:, None] for k, v in a.items()}) for a, _, _ in step]
        ms, how = bench(lambda i: kda_decode(**{k: v[:, 0] for k, v in strided[i].items()}, **step[i][1],
                                             **step[i][2]), n_sets)
        add("k3c fused decode, default, row-strided activations (fused GEMM views)", ms, how)
        del strided
        ms, how = bench(lambda i: kda_prefill(**{k: v[:, None] for k, v in step[i][0].items()}, **step[i][1],
                                              **step[i][2], method="recurrent"), n_sets)
        add("k3c token-loop kernel (the previous decode path)", ms, how)
        ms, how = bench(lambda i: eager_decode_step(**step[i][0], **step[i][1], **step[i][2]), n_sets)
        add("torch eager step", ms, how)
        if do_compile:
            try:
                compiled = torch.compile(eager_decode_step, dynamic=False)
                ms, how = bench(lambda i: compiled(**step[i][0], **step[i][1], **step[i][2]), n_sets)
                add("torch.compile step", ms, how)
            except Exception as e:  # noqa: BLE001
                print(f"# torch.compile failed: {e!r}", flush=True)
        if have_fla:
            from fla.modules.causal_conv1d import causal_conv1d_update
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
            fla_sets = []
            for a, w, s in step:
                qkv = torch.cat([a["q_in"], a["k_in"], a["v_in"]], -1)            # fused qkv projection output
                fla_sets.append((qkv, torch.cat([w["conv_w_q"], w["conv_w_k"], w["conv_w_v"]], 0), a, w, s))

            def fla_step(i):
                qkv, cw, a, w, s = fla_sets[i]
                x = causal_conv1d_update(qkv, s["conv_state"], weight=cw, activation="silu")
                x = x[0] if isinstance(x, tuple) else x                            # (y, cache) in fla 0.6
                q, k, v = (t.view(B, 1, H, D) for t in x.split(HD, -1))
                o, _ = fused_recurrent_kda_fwd(
                    q, k, v, a["f"].view(B, 1, H, D), a["beta_logits"].view(B, 1, H), A_log=w["A_log"],
                    dt_bias=w["dt_bias"], initial_state=s["state"], scale=D ** -0.5, output_final_state=True,
                    inplace_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
                return rms_norm_gated(o.view(-1, D), a["gate_logits"].view(-1, D), w["o_norm_weight"], None,
                                      activation="sigmoid", eps=1e-5)
            try:
                ms, how = bench(fla_step, n_sets)
                add("FLA conv_update + fused_recurrent_kda + rms_norm_gated", ms, how)
            except Exception as e:  # noqa: BLE001
                print(f"# FLA decode failed: {e!r}", flush=True)
        del sets, step


def prefill_rows(dev, have_fla, rows, Ts, chunk_cfgs, fla_Ts, profile_Ts=(8192,)):
    for T in Ts:
        B = 1
        acts, weights, state = make(B, T, dev, seed=4)
        flop = B * T * H * (6 * D * D + 10 * 64 * D)
        nbytes = B * T * (6 * HD + H) * 2 + B * H * D * D * 8 + B * 3 * HD * W * 8

        def add(name, ms, how):
            rows.append(dict(kind="prefill", B=B, T=T, impl=name, ms=ms, how=how, GBps=nbytes / ms / 1e6,
                             TFLOPs=flop / ms / 1e9, frac_790=flop / ms / 1e-3 / BF16_FLOP_PER_S))
            print("ROW", rows[-1], flush=True)

        for bv, nw, pw, chunk, ft, fw in chunk_cfgs:
            with prep_config(pw, chunk, ft, fw):
                try:
                    ms, how = bench(lambda i, bv=bv, nw=nw: kda_prefill(**acts, **weights, **state, method="chunk",
                                                                        block_v=bv, num_warps=nw), 1)
                except Exception as e:  # noqa: BLE001  keep the other configurations
                    print(f"# prefill T={T} {(bv, nw, pw, chunk, ft, fw)} failed: {e!r}", flush=True)
                    continue
                add(f"k3c chunked prefill, chunk {chunk} (state pass block_v={bv}, num_warps={nw}; prep {pw} warps"
                    f"; front {ft} tokens x {fw} warps)", ms, how)
                if T in profile_Ts:
                    profile_kernels(f"prefill T={T} chunk={chunk} block_v={bv} nw={nw} pw={pw} ft={ft} fw={fw}",
                                    lambda: kda_prefill(**acts, **weights, **state, method="chunk", block_v=bv,
                                                        num_warps=nw))
        if have_fla and T in fla_Ts:
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            from fla.ops.kda import chunk_kda
            qkv = torch.cat([acts["q_in"], acts["k_in"], acts["v_in"]], -1)
            cw = torch.cat([weights["conv_w_q"], weights["conv_w_k"], weights["conv_w_v"]], 0)

            def fla_prefill(i):
                x, conv_final = causal_conv1d(qkv, cw, initial_state=state["conv_state"], output_final_state=True,
                                              activation="silu")
                q, k, v = (t.reshape(B, T, H, D) for t in x.split(HD, -1))
                o, s_final = chunk_kda(q, k, v, acts["f"].view(B, T, H, D), acts["beta_logits"], scale=D ** -0.5,
                                       initial_state=state["state"], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, A_log=weights["A_log"],
                                       dt_bias=weights["dt_bias"], safe_gate=True, lower_bound=-5.0)
                return rms_norm_gated(o.reshape(-1, D), acts["gate_logits"].view(-1, D), weights["o_norm_weight"],
                                      None, activation="sigmoid", eps=1e-5)
            try:
                with torch.inference_mode():
                    y_fla = fla_prefill(0).view(B, T, HD)
                    st = {k: v.clone() for k, v in state.items()}
                    y_k3c = kda_prefill(**acts, **weights, **st, method="chunk")
                    print(f"# FLA vs k3c prefill T={T}: y rel err {rel_err(y_k3c, y_fla):.3g}", flush=True)
                    ms, how = bench(fla_prefill, 1)
                    if T in profile_Ts:
                        profile_kernels(f"FLA prefill T={T}", lambda: fla_prefill(0))
                add("FLA causal_conv1d + chunk_kda + rms_norm_gated", ms, how)
            except Exception as e:  # noqa: BLE001
                print(f"# FLA prefill failed: {e!r}", flush=True)
        del acts, state


def spec_rows(dev, rows, checks):
    """kda_spec_replay at B = 16: replay all k draft tokens (checked against k decode steps first)."""
    B = 16
    for k in (2, 4, 8):
        acts, weights, state = make(B, k, dev, seed=6)
        drafts = {n: v for n, v in acts.items() if n != "gate_logits"}
        w = {n: v for n, v in weights.items() if n != "o_norm_weight"}
        want = {n: v.clone() for n, v in state.items()}
        for t in range(k):
            kda_decode(**{n: v[:, t] for n, v in acts.items()}, **weights, **want)
        for method in ("recurrent", "chunk"):
            st = {n: v.clone() for n, v in state.items()}
            kda_spec_replay(**drafts, **w, **st, n_accepted=k, method=method)
            r = dict(check=f"spec replay {method} B=16 k={k} vs {k} decode steps", y_rel=0.0,
                     state_rel=rel_err(st["state"], want["state"]), conv_rel=rel_err(st["conv_state"],
                                                                                      want["conv_state"]))
            r["ok"] = r["state_rel"] < 1e-2
            checks.append(r)
            print("CHECK", r, flush=True)
            ms, how = bench(lambda i, method=method: kda_spec_replay(**drafts, **w, **st, n_accepted=k,
                                                                     method=method), 1)   # st: a scratch copy
            nbytes = B * H * D * D * 8 + B * k * (5 * HD + H) * 2
            rows.append(dict(kind="spec replay", B=B, T=k, impl=f"k3c kda_spec_replay ({method})", ms=ms, how=how,
                             GBps=nbytes / ms / 1e6, roofline=nbytes / ms / 1e-3 / HBM_BYTES_PER_S))
            print("ROW", rows[-1], flush=True)


def write_table(rows, checks, out):
    lines = ["| kind | B | T | implementation | time (us) | GB/s | % of 4.2 TB/s | TFLOP/s | % of 790 | timing |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tf = f"{r['TFLOPs']:.1f}" if "TFLOPs" in r else ""
        fr = f"{100 * r['frac_790']:.1f}" if "frac_790" in r else ""
        roof = f"{100 * r['roofline']:.1f}" if "roofline" in r else f"{100 * r['GBps'] * 1e9 / HBM_BYTES_PER_S:.1f}"
        lines.append(f"| {r['kind']} | {r['B']} | {r['T']} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['GBps']:.0f} | "
                     f"{roof} | {tf} | {fr} | {r['how']} |")
    lines += ["", "| GPU check (bf16 in, fp32 reference) | y rel L2 | state rel L2 | conv state rel L2 | ok |",
              "|---|---|---|---|---|"]
    lines += [f"| {c['check']} | {c['y_rel']:.2e} | {c['state_rel']:.2e} | {c['conv_rel']:.2e} | {c['ok']} |"
              for c in checks]
    text = "\n".join(lines)
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "kda_bench.md"), "w") as fh:
            fh.write(text + "\n")
        with open(os.path.join(out, "kda_bench.json"), "w") as fh:
            json.dump(dict(rows=rows, checks=checks, device=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=triton.__version__), fh, indent=1)


def parse_tuples(text, defaults):
    """'a:b:c,...' -> int tuples, missing trailing fields taken from `defaults`."""
    out = []
    for p in text.split(","):
        if p:
            vals = [int(x) for x in p.split(":")]
            out.append(tuple(vals + list(defaults[len(vals):])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--prefill-T", default="1024,8192,32768")
    ap.add_argument("--decode", default="0:0,0:0:1,0:0:2,0:0:3,32:2:2,64:8:2",
                    help="fp32 state: block_v:num_warps[:variant[:front_warps]],... (0 = the launcher's default; "
                         "variant 1 one launch, 2 front + state kernel with PDL, 3 the same without PDL)")
    ap.add_argument("--decode-bf16", default="0:0,0:0:1,0:0:2,0:0:3,64:2:2,64:4:2",
                    help="bf16 state: as --decode")
    ap.add_argument("--profile-decode", action="store_true", help="per-kernel times of the two-phase decode")
    ap.add_argument("--decode-conv", default="f32,bf16", help="conv-state dtypes of the decode rows")
    ap.add_argument("--chunk", default="64:4:4,32:4:4,128:8:4",
                    help="block_v:num_warps:prep_warps[:chunk[:front_tokens[:front_warps]]],... of the chunk state "
                         "pass, the intra-chunk kernel and the front kernel")
    ap.add_argument("--profile-T", default="8192", help="prefill lengths with per-kernel profiles")
    ap.add_argument("--decode-B", default="1,16,64", help="decode batch sizes")
    ap.add_argument("--lean", action="store_true", help="decode: only the k3c split rows")
    ap.add_argument("--fla-prefill-T", default="8192", help="prefill lengths with an FLA row")
    ap.add_argument("--stages", default="check,drift,decode,prefill,spec")
    args = ap.parse_args()
    dev = "cuda"
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    have_fla = fla_available()
    rows, checks = [], []
    torch.backends.cuda.matmul.allow_tf32 = False
    decode_cfgs = {torch.float32: parse_tuples(args.decode, (0, 0, 0, 0)),
                   torch.bfloat16: parse_tuples(args.decode_bf16, (0, 0, 0, 0))}
    chunk_cfgs = parse_tuples(args.chunk, (kda_module.CHUNK_BLOCK_V, 4, kda_module.CHUNK_PREP_WARPS, kda_module.CHUNK,
                                           kda_module.CHUNK_FRONT_TOKENS, kda_module.CHUNK_FRONT_WARPS))
    conv_dtypes = [{"f32": torch.float32, "bf16": torch.bfloat16}[c] for c in args.decode_conv.split(",")]
    stages = {"check": lambda: check_gpu(dev, checks, decode_cfgs, chunk_cfgs, conv_dtypes),
              "drift": lambda: bf16_state_drift(dev, checks),
              "decode": lambda: decode_rows(dev, have_fla, rows, decode_cfgs, not args.no_compile,
                                            [int(b) for b in args.decode_B.split(",")], args.lean,
                                            args.profile_decode, conv_dtypes),
              "prefill": lambda: prefill_rows(dev, have_fla, rows, [int(t) for t in args.prefill_T.split(",")],
                                              chunk_cfgs, [int(t) for t in args.fla_prefill_T.split(",") if t],
                                              [int(t) for t in args.profile_T.split(",") if t]),
              "spec": lambda: spec_rows(dev, rows, checks)}
    for name in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            stages[name]()
        except Exception as e:  # noqa: BLE001  keep the other stages' numbers
            import traceback
            traceback.print_exc()
            print(f"# stage {name} failed: {e!r}", flush=True)
        print(f"# stage {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        write_table(rows, checks, args.out)


if __name__ == "__main__":
    main()
