"""Fused KDA Triton kernels (k3c.codegen.triton.kda) under the Triton interpreter, fp32, small shapes.

Oracles: FLA's `naive_recurrent_kda` (an independent implementation of the recurrence, fed by torch's conv1d and
FLA's naive gates) and `kda_fused_reference` (per-token loop from K3-SPEC.md "KDA layer"). Tolerance: 1e-5 abs.
"""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors need the interpreter; set before triton.jit runs

import pytest
import torch
import torch.nn.functional as F

from k3c.codegen.triton import kda as kda_module
from k3c.codegen.triton.kda import (
    emit_source,
    kda_decode,
    kda_fused_reference,
    kda_prefill,
    kda_spec_replay,
)
from k3c.errors import RuntimeInputError, UnsupportedError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run the kernels under TRITON_INTERPRET=1")

TOL = 1e-5
W = 4


def make_inputs(B, T, H, D, *, seed, gate_kind="lower_bound", f_shift=0.0, A_log_value=None):
    """Random fp32 inputs of the fused op (activations [B,T,H*D]) and a random state / conv state."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=gen) * s

    HD = H * D
    A_log = r(H + 3, s=0.5) if A_log_value is None else torch.full((H + 3,), float(A_log_value))
    acts = dict(q_in=r(B, T, HD), k_in=r(B, T, HD), v_in=r(B, T, HD), f=r(B, T, HD, s=0.3) + f_shift,
                beta_logits=r(B, T, H), gate_logits=r(B, T, HD))
    weights = dict(conv_w_q=r(HD, W, s=0.5), conv_w_k=r(HD, W, s=0.5), conv_w_v=r(HD, W, s=0.5), A_log=A_log,
                   dt_bias=r(HD, s=0.3 if A_log_value is None else 0.0), o_norm_weight=1 + 0.1 * r(D))
    state = dict(state=r(B, H, D, D, s=0.1), conv_state=r(B, 3 * HD, W))
    return acts, weights, state


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def slice_t(acts, t0, t1):
    return {k: v[:, t0:t1] for k, v in acts.items()}


def assert_close(got, want, what):
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


def fla_oracle(acts, weights, state, *, gate_kind, lower_bound=-5.0, eps=1e-5):
    """The fused op assembled from torch conv1d + FLA's naive gate + naive_recurrent_kda + torch RMSNorm."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    B, T, HD = acts["q_in"].shape
    D = weights["o_norm_weight"].numel()
    H = HD // D
    conv = state["conv_state"]
    outs = []
    for i, (name, w) in enumerate((("q_in", "conv_w_q"), ("k_in", "conv_w_k"), ("v_in", "conv_w_v"))):
        hist = conv[:, i * HD:(i + 1) * HD, 1:]                                  # last W-1 raw inputs
        x = torch.cat([hist, acts[name].transpose(1, 2)], -1)                    # [B, HD, W-1+T]
        outs.append(F.silu(F.conv1d(x, weights[w][:, None, :], groups=HD)).transpose(1, 2).reshape(B, T, H, D))
    q, k, v = outs
    q = q / torch.sqrt((q ** 2).sum(-1, keepdim=True) + 1e-6)                   # l2norm, eps 1e-6 (K3-SPEC)
    k = k / torch.sqrt((k ** 2).sum(-1, keepdim=True) + 1e-6)
    f = acts["f"].reshape(B, T, H, D)
    if gate_kind == "lower_bound":
        g = naive_kda_lowerbound_gate(f, weights["A_log"][:H], weights["dt_bias"], lower_bound=lower_bound)
    else:
        g = naive_kda_gate(f, weights["A_log"][:H], weights["dt_bias"])
    beta = torch.sigmoid(acts["beta_logits"])
    o, S = naive_recurrent_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=state["state"],
                               output_final_state=True)
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * weights["o_norm_weight"]
    y = o * torch.sigmoid(acts["gate_logits"].reshape(B, T, H, D))
    return y.reshape(B, T, HD), S


@pytest.mark.parametrize("D,T", [(60, 1), (60, 2), (60, 3), (60, 5), (60, 37), (60, 70), (100, 3), (100, 37),
                                 (64, 5), (64, 70)])
def test_reference_matches_fla_naive(D, T):
    acts, weights, state = make_inputs(2, T, 2, D, seed=T + D)
    y_ref, S_ref, _ = kda_fused_reference(**acts, **weights, **state)
    y_fla, S_fla = fla_oracle(acts, weights, state, gate_kind="lower_bound")
    assert_close(y_ref, y_fla, "reference vs FLA y")
    assert_close(S_ref, S_fla, "reference vs FLA state")


@pytest.mark.parametrize("method", ["recurrent", "chunk"])
@pytest.mark.parametrize("D,T", [(60, 1), (60, 2), (60, 3), (60, 5), (60, 37), (60, 70), (100, 3), (100, 37),
                                 (64, 5), (64, 70)])
def test_prefill_matches_reference_and_fla(method, D, T):
    B, H = (1, 2) if method == "recurrent" and T > 30 else (2, 2)
    acts, weights, state = make_inputs(B, T, H, D, seed=7 * T + D)
    y_ref, S_ref, C_ref = kda_fused_reference(**acts, **weights, **state)
    st = clone(state)
    y = kda_prefill(**acts, **weights, **st, method=method)
    assert_close(y, y_ref, "y")
    assert_close(st["state"], S_ref, "state")
    assert_close(st["conv_state"], C_ref, "conv state")
    if T in (3, 37):
        y_fla, S_fla = fla_oracle(acts, weights, state, gate_kind="lower_bound")
        assert_close(y, y_fla, "y vs FLA")
        assert_close(st["state"], S_fla, "state vs FLA")


@pytest.mark.parametrize("method", ["recurrent", "chunk"])
def test_gates_at_lower_bound(method):
    # f + dt_bias = +40 saturates the sigmoid: every g is the bound -5 (the chunk kernel's worst case).
    acts, weights, state = make_inputs(1, 37, 2, 60, seed=3, f_shift=40.0)
    y_ref, S_ref, _ = kda_fused_reference(**acts, **weights, **state)
    st = clone(state)
    y = kda_prefill(**acts, **weights, **st, method=method)
    assert_close(y, y_ref, "y")
    assert_close(st["state"], S_ref, "state")


@pytest.mark.parametrize("f_shift", [0.0, 40.0])
def test_chunk_32(monkeypatch, f_shift):
    # 32-token chunks (the middle reference row keeps every needed factor below exp(16 * 5)), random gates and gates
    # at the bound -5, ragged lengths
    monkeypatch.setattr(kda_module, "CHUNK", 32)
    acts, weights, state = make_inputs(2, 70, 2, 60, seed=47, f_shift=f_shift)
    run = clone(state)
    y = kda_prefill(**acts, **weights, **run, method="chunk", lengths=[70, 45])
    for b, n in enumerate((70, 45)):
        y_ref, S_ref, C_ref = kda_fused_reference(**{k: v[b:b + 1, :n] for k, v in acts.items()}, **weights,
                                                  **{k: v[b:b + 1] for k, v in state.items()})
        assert_close(y[b:b + 1, :n], y_ref, f"y row {b}")
        assert_close(run["state"][b:b + 1], S_ref, f"state row {b}")
        assert_close(run["conv_state"][b:b + 1], C_ref, f"conv state row {b}")


def test_kimi_linear_gate_minus_eight():
    # A_log = log 8 and f + dt_bias = log(e - 1) give g = -8 * softplus(...) ~ -8 (random +-0.3 around it).
    acts, weights, state = make_inputs(1, 21, 2, 60, seed=5, f_shift=0.5413, A_log_value=2.0794415)
    y_ref, S_ref, C_ref = kda_fused_reference(**acts, **weights, **state, gate_kind="softplus")
    y_fla, S_fla = fla_oracle(acts, weights, state, gate_kind="softplus")
    assert_close(y_ref, y_fla, "reference vs FLA")
    st = clone(state)
    y = kda_prefill(**acts, **weights, **st, gate_kind="softplus")          # auto: recurrent kernel
    assert_close(y, y_ref, "y")
    assert_close(st["state"], S_ref, "state")
    assert_close(st["conv_state"], C_ref, "conv state")
    with pytest.raises(UnsupportedError):
        kda_prefill(**acts, **weights, **clone(state), gate_kind="softplus", method="chunk")


@pytest.mark.parametrize("method", ["recurrent", "chunk"])
def test_prefill_in_pieces_equals_one_prefill(method):
    acts, weights, state = make_inputs(1, 37, 2, 60, seed=11)
    whole = clone(state)
    y_whole = kda_prefill(**acts, **weights, **whole, method=method)
    parts = clone(state)
    ys = []
    for t0, t1 in ((0, 2), (2, 19), (19, 35), (35, 37)):
        ys.append(kda_prefill(**slice_t(acts, t0, t1), **weights, **parts, method=method))
    assert_close(torch.cat(ys, 1), y_whole, "y")
    assert_close(parts["state"], whole["state"], "state")
    assert_close(parts["conv_state"], whole["conv_state"], "conv state")


def test_decode_after_prefill_equals_prefill():
    T0, steps = 18, 3
    acts, weights, state = make_inputs(2, T0 + steps, 2, 64, seed=13)
    whole = clone(state)
    y_whole = kda_prefill(**acts, **weights, **whole, method="chunk")
    run = clone(state)
    kda_prefill(**slice_t(acts, 0, T0), **weights, **run, method="chunk")
    for t in range(T0, T0 + steps):
        y_t = kda_decode(**{k: v[:, t] for k, v in acts.items()}, **weights, **run)
        assert y_t.shape == acts["q_in"][:, t].shape
        assert_close(y_t, y_whole[:, t], f"decode y at {t}")
    assert_close(run["state"], whole["state"], "state")
    assert_close(run["conv_state"], whole["conv_state"], "conv state")


@pytest.mark.parametrize("variant", ["fused", "front"])
@pytest.mark.parametrize("block_v", [16, 32, 64])
def test_decode_split_over_v(block_v, variant):
    # D = 60: 4, 2 or 1 value blocks per head (the last one partly masked); 3 steps reuse the reset counters.
    # "front": the front-end kernel, then the state kernel (on CPU without programmatic dependent launch)
    acts, weights, state = make_inputs(2, 3, 3, 60, seed=29)
    y_ref, S_ref, C_ref = kda_fused_reference(**acts, **weights, **state)
    run = clone(state)
    for t in range(3):
        y_t = kda_decode(**{k: v[:, t] for k, v in acts.items()}, **weights, **run, block_v=block_v,
                         variant=variant)
        assert_close(y_t, y_ref[:, t], f"decode y at {t}")
    assert_close(run["state"], S_ref, "state")
    assert_close(run["conv_state"], C_ref, "conv state")


@pytest.mark.parametrize("method", ["decode", "decode_front", "chunk"])
def test_bf16_state_is_rounded_fp32_state(method):
    # the kernels keep the state in fp32 and round it once on the way out: y is exact for the bf16 input state,
    # the new state within one bf16 ulp (2^-7 relative; the interpreter truncates, the GPU rounds to nearest)
    T = 1 if method.startswith("decode") else 21
    acts, weights, state = make_inputs(1, T, 2, 64, seed=31)
    state["state"] = state["state"].to(torch.bfloat16)
    y_ref, S_ref, _ = kda_fused_reference(**acts, **weights, **state)
    run = clone(state)
    if method.startswith("decode"):
        variant = "front" if method == "decode_front" else "fused"
        y = kda_decode(**{k: v[:, 0] for k, v in acts.items()}, **weights, **run, variant=variant)[:, None]
    else:
        y = kda_prefill(**acts, **weights, **run, method="chunk")
    assert run["state"].dtype == torch.bfloat16
    assert_close(y, y_ref, "y")
    err = (run["state"].double() - S_ref.double()).abs()
    assert (err <= S_ref.double().abs() * 2 ** -7 + TOL).all(), "state beyond one bf16 ulp of the reference"


@pytest.mark.parametrize("method", ["decode_front", "chunk"])
def test_bf16_conv_state_equals_fp32_conv_state(method):
    # bf16 activations: the conv state holds raw bf16 inputs, so storing it in bf16 changes nothing, bit for bit
    # (decode: conv_window / store_conv_window; chunk: conv_silu_rows and roll_conv_state, as the token loop)
    T = 1 if method == "decode_front" else 17
    acts, weights, state = make_inputs(2, T, 2, 32, seed=43)
    acts = {k: v.to(torch.bfloat16) for k, v in acts.items()}
    state["conv_state"] = state["conv_state"].to(torch.bfloat16)
    runs = []
    for conv_dtype in (torch.bfloat16, torch.float32):
        st = clone(state)
        st["conv_state"] = st["conv_state"].to(conv_dtype)
        if method == "decode_front":
            y = kda_decode(**{k: v[:, 0] for k, v in acts.items()}, **weights, **st, variant="front")
        else:                                               # y past a row's length is left unwritten
            y = kda_prefill(**acts, **weights, **st, method="chunk", lengths=[17, 9])
            y = torch.cat([y[0, :17], y[1, :9]])
        runs.append((y, st))
    (y16, st16), (y32, st32) = runs
    assert st16["conv_state"].dtype == torch.bfloat16 and torch.equal(y16, y32)
    assert torch.equal(st16["state"], st32["state"]) and torch.equal(st16["conv_state"].float(), st32["conv_state"])
    with pytest.raises(UnsupportedError, match="conv_state"):  # bf16 conv state with fp32 activations: not exact
        kda_decode(**{k: v[:, 0].float() for k, v in acts.items()}, **weights, **clone(state))


@pytest.mark.parametrize("lengths", [None, [37, 20]])
def test_chunk_state_pass_split_over_v(lengths):
    # block_v = 16 < D: four state programs per head, O through the fp32 buffer and the separate norm kernel
    acts, weights, state = make_inputs(2, 37, 2, 60, seed=37)
    run = clone(state)
    y = kda_prefill(**acts, **weights, **run, method="chunk", block_v=16, lengths=lengths)
    n = [37, 37] if lengths is None else lengths
    for b in range(2):
        y_ref, S_ref, C_ref = kda_fused_reference(**{k: v[b:b + 1, :n[b]] for k, v in acts.items()}, **weights,
                                                  **{k: v[b:b + 1] for k, v in state.items()})
        assert_close(y[b:b + 1, :n[b]], y_ref, f"y row {b}")
        assert_close(run["state"][b:b + 1], S_ref, f"state row {b}")
        assert_close(run["conv_state"][b:b + 1], C_ref, f"conv state row {b}")


def as_fused_views(acts):
    """The activations as column views of one [B, T, N] buffer, like `fuse_gemms`' split of one GEMM output: each
    keeps a row stride of N elements (and N*T between batch rows), none is contiguous."""
    order = ("q_in", "beta_logits", "k_in", "gate_logits", "v_in", "f")
    B, T, _ = acts["q_in"].shape
    buf = torch.cat([acts[k] for k in order] + [torch.full((B, T, 3), float("nan"))], -1)
    views = dict(zip(order, torch.split(buf, [acts[k].shape[-1] for k in order] + [3], -1)))
    assert not any(v.is_contiguous() for v in views.values())
    return views


@pytest.mark.parametrize("method", ["decode", "decode_front", "recurrent", "chunk"])
def test_row_strided_inputs_equal_contiguous(method):
    # the kernels read row-strided views in place (no copy): same results, bit for bit, as contiguous inputs
    T = 1 if method.startswith("decode") else 19
    acts, weights, state = make_inputs(2, T, 2, 60, seed=41)
    views = as_fused_views(acts)
    runs = []
    for a in (acts, views):
        st = clone(state)
        if method.startswith("decode"):
            y = kda_decode(**{k: v[:, 0] for k, v in a.items()}, **weights, **st, block_v=32,
                           variant="front" if method == "decode_front" else "fused")
        else:
            y = kda_prefill(**a, **weights, **st, method=method, block_v=16)
        runs.append((y, st))
    (y0, st0), (y1, st1) = runs
    assert y1.is_contiguous() and torch.equal(y1, y0), "y"
    assert torch.equal(st1["state"], st0["state"]) and torch.equal(st1["conv_state"], st0["conv_state"])


@pytest.mark.parametrize("n_accepted", [0, 1, 5, [0, 3]])
@pytest.mark.parametrize("method", ["recurrent", "chunk"])
def test_spec_replay_equals_running_accepted_tokens(n_accepted, method):
    k_draft = 5
    acts, weights, state = make_inputs(2, k_draft, 2, 60, seed=17)
    drafts = {k: v for k, v in acts.items() if k != "gate_logits"}
    weights_replay = {k: v for k, v in weights.items() if k != "o_norm_weight"}
    replay = clone(state)
    kda_spec_replay(**drafts, **weights_replay, **replay, n_accepted=n_accepted, method=method)
    n = torch.as_tensor(n_accepted).expand(2)
    for b in range(2):
        want = {k: v[b:b + 1].clone() for k, v in state.items()}
        if n[b] > 0:
            kda_prefill(**{k: v[b:b + 1, :n[b]] for k, v in acts.items()}, **weights, **want, method="recurrent")
        assert_close(replay["state"][b:b + 1], want["state"], f"state row {b}")
        assert_close(replay["conv_state"][b:b + 1], want["conv_state"], f"conv state row {b}")


@pytest.mark.parametrize("family,gate_kind,T", [("prefill", "lower_bound", 21), ("decode", "lower_bound", 1),
                                                ("prefill", "softplus", 6)])
def test_emitted_module_imports_and_matches(tmp_path, family, gate_kind, T):
    H, D = 2, 60
    src = emit_source({"family": family, "heads": H, "head_dim": D, "gate_kind": gate_kind, "lower_bound": -5.0,
                       "eps": 1e-5, "ir_nodes": ["layers.0.kda"]})
    assert "layers.0.kda" in src and f"H={H}, D={D}, W=4" in src and "@triton.jit" in src
    path = tmp_path / f"kda_{family}_{gate_kind}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    acts, weights, state = make_inputs(1, T, H, D, seed=19)
    y_ref, S_ref, C_ref = kda_fused_reference(**acts, **weights, **state, gate_kind=gate_kind)
    # decode: the module's own rule picks the one-launch kernel at B*H = 2; from 0 rows on, the two-phase form
    for min_rows in ([module.DECODE_FRONT_MIN_ROWS, 0] if family == "decode" else [None]):
        module.DECODE_FRONT_MIN_ROWS = min_rows
        st = clone(state)
        y = module.launch(**acts, **weights, **st)
        assert_close(y, y_ref, f"emitted y ({min_rows})")
        assert_close(st["state"], S_ref, f"emitted state ({min_rows})")
        assert_close(st["conv_state"], C_ref, f"emitted conv state ({min_rows})")
    with pytest.raises(RuntimeInputError):
        bad = make_inputs(1, 1, H, 64, seed=0)
        module.launch(**bad[0], **bad[1], **bad[2])


def test_errors():
    acts, weights, state = make_inputs(1, 3, 2, 60, seed=23)
    with pytest.raises(RuntimeInputError):
        kda_prefill(**{**acts, "beta_logits": acts["beta_logits"][..., :1]}, **weights, **clone(state))
    with pytest.raises(UnsupportedError):
        kda_prefill(**acts, **weights, **clone(state), gate_kind="relu")
    with pytest.raises(UnsupportedError):
        kda_prefill(**acts, **{**weights, "A_log": weights["A_log"].double()}, **clone(state))
    with pytest.raises(RuntimeInputError):
        kda_spec_replay(**{k: v for k, v in acts.items() if k != "gate_logits"},
                        **{k: v for k, v in weights.items() if k != "o_norm_weight"}, **clone(state), n_accepted=4)
    with pytest.raises(UnsupportedError):
        emit_source({"family": "prefill", "heads": 2, "head_dim": 60, "gate_kind": "softplus", "chunked": True})
    with pytest.raises(UnsupportedError):
        kda_decode(**{k: v[:, 0] for k, v in acts.items()}, **weights, **clone(state), variant="persistent")
