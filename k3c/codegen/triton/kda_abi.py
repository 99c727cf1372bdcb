"""Kernel-ABI emitter for `kda_fused`: wraps the fused KDA kernels of `k3c.codegen.triton.kda` in a module
implementing `launch(inputs, outputs, sizes)`.

Math: K3-SPEC.md "KDA layer"; exact semantics: `kda_fused_ref` of k3c/ir/ops/model_kda.py. The kernel text is
`kda.emit_source` of the "prefill" family (the decode kernels, the token-loop kernel and the chunk-parallel
prefill kernels), with two edits so that the module stands alone and keeps the ABI
name free: its `from k3c.errors import ...` becomes two local exception classes (subclasses of ValueError), and its
own `launch(q_in, ...)` is renamed `kda_family_launch`. The ABI `launch` maps the IR operands onto `_launch_kda`:

    inputs  (q, k, v, f, beta, gate, q_conv, k_conv, v_conv, A_log, dt_bias, o_norm, state, conv_state)
    outputs (y [B,T,H·K], new state [B,H,K,K] in the state's dtype (f32 or bf16), new conv state [B,3·H·K,W])

T == 1 (decode) runs the decode step like `kda.kda_decode`: the one-launch split-V kernel, or from B·H ≥
`kda.DECODE_FRONT_MIN_ROWS` on the front-end kernel and the state kernel as its programmatic dependent launch
(`kda.decode_split`; both launches inside this module's one schedule launch); T > 1 (prefill) runs the chunked
kernels when the gate is safely bounded and T ≥ 16, else the token loop, like `kda.kda_prefill(method="auto")`.
The state outputs may be the very tensors of the state inputs (in-place update) or separate ones. The six
activations may be row-strided views (any batch / token strides, dense last dim: in decode, the column views of
the one GEMM output `fuse_gemms` makes of the projections): the module declares `TAKES_VIEWS`, so that the runtime's
Triton launcher passes them without a copy (other inputs are made contiguous here where they are not). Conv weights
[H·K,1,W] are viewed as [H·K,W]; non-fp32 weights are converted (the kernels take fp32). The conv state goes to the
kernels as it is stored when that is f32 or the activations' dtype (a bf16 model stores it in bf16: exact, half the
bytes), otherwise it is converted to f32 and copied back. The recurrent state goes to the kernels as it is stored,
f32 or bf16 (`--kda-state`): they load it, compute in f32 and round the new state once per call.

Scratch (`kda_fused_scratch`, planned in the arena; the decode kernels' o_part, counters and front-end outputs,
(5·K + 2)·B·H·4 bytes, stay cached in the module, one set per shape, shared by the layers): the
chunked prefill's workspace ws [4, B, H, NC, 16, K] and ws_p [B, H, NC, 16, 16] in q's dtype, ws_glast f32
[B, H, NC, K] (NC = ⌈T/16⌉ chunks) and, when the state pass does not fuse the norm epilogue (CHUNK_BLOCK_V < K),
o_buf [B, T, H·K] in q's dtype.

Public API: `emit_kda_fused(group)` -> module text (registered with `k3c.codegen.triton.emitter` for the kind
"kda_fused"), `kda_fused_scratch(group)` (registered with `k3c.codegen.triton.scratch`).
"""

from __future__ import annotations

import sympy
import triton

from k3c.codegen.backend import ScratchSpec
from k3c.codegen.triton import emitter, module_header, one_node, scratch
from k3c.codegen.triton.kda import CHUNK, CHUNK_BLOCK_V, chunk_is_safe, emit_source
from k3c.errors import UnsupportedError
from k3c.ir.kernels import KernelGroup
from k3c.ir.types import TensorType

_ERRORS_IMPORT = "from k3c.errors import RuntimeInputError, UnsupportedError"
_LOCAL_ERRORS = '''class RuntimeInputError(ValueError):
    """Bad runtime input (stands in for k3c.errors.RuntimeInputError: kernel modules do not import k3c)."""


class UnsupportedError(ValueError):
    """Input this specialization does not handle (stands in for k3c.errors.UnsupportedError)."""'''

_ABI_LAUNCH = '''

def launch(inputs, outputs, sizes, scratch=None):
    """ABI entry (see the header): decode kernel when T == 1, prefill (chunked or token loop) otherwise; scratch:
    the chunked prefill's planned buffers (kda_fused_scratch; None: allocated)."""
    (q, k, v, f, beta, gate, q_conv, k_conv, v_conv, A_log, dt_bias, o_norm, state,
     conv_state) = [inputs[i] for i in INPUT_POSITIONS]
    y, state_out, conv_out = [outputs[i] for i in OUTPUT_POSITIONS]
    T = q.shape[1]
    conv_w = [w.reshape(w.shape[0], w.shape[-1]).float() for w in (q_conv, k_conv, v_conv)]
    state = state.contiguous()
    conv_ok = (torch.float32, q.dtype)                     # the kernels' conv-state dtypes (kda._launch_kda)
    conv_in = conv_state.contiguous() if conv_state.dtype in conv_ok else conv_state.float().contiguous()
    conv_dst = conv_out if conv_out.dtype == conv_in.dtype and conv_out.is_contiguous() else conv_in
    mode = "decode" if T == 1 else "chunk" if CHUNKED and T >= CHUNK_MIN_TOKENS else "recurrent"
    direct = y.is_contiguous() and y.dtype == q.dtype      # the kernels write y in place
    y_new = _launch_kda(mode, q, k, v, f, beta, gate,
                        *conv_w, A_log.reshape(-1).float(), dt_bias.reshape(-1).float(), o_norm.float(), state,
                        conv_in, gate_kind=GATE_KIND, lower_bound=LOWER_BOUND, eps=EPS, lengths=None,
                        state_out=state_out, conv_state_out=conv_dst, store_output=True, num_warps=None,
                        y_out=y if direct else None,
                        scratch=scratch if mode == "chunk" else None)
    if not direct:
        y.copy_(y_new)
    if conv_dst is not conv_out:
        conv_out.copy_(conv_dst)
'''


@scratch("kda_fused")
def kda_fused_scratch(group: KernelGroup) -> list[ScratchSpec]:
    """The chunked prefill's scratch of one `kda_fused` launch (module docstring; `kda._launch_kda` "chunk"): none
    when the gate forbids the chunk kernel or the entry has one token per row (decode). Raises UnsupportedError for
    a group that is not a single kda_fused node."""
    node, _, _ = one_node(group, "kda_fused")
    a = node.attrs
    q = node.inputs[0].type
    B, T, HD = q.shape
    if not chunk_is_safe(a["gate"], a["lower_bound"]) or T == 1:
        return []
    H, D = a["heads"], a["head_dim"]
    NC = sympy.ceiling(sympy.sympify(T) / CHUNK)
    out = [ScratchSpec("ws", TensorType((4, B, H, NC, CHUNK, D), q.dtype)),
           ScratchSpec("ws_p", TensorType((B, H, NC, CHUNK, CHUNK), q.dtype)),
           ScratchSpec("ws_glast", TensorType((B, H, NC, D), "f32"))]
    if min(triton.next_power_of_2(D), CHUNK_BLOCK_V) != triton.next_power_of_2(D):   # norm epilogue not fused
        out.append(ScratchSpec("o_buf", TensorType((B, T, HD), q.dtype)))
    return out


@emitter("kda_fused")
def emit_kda_fused(group: KernelGroup) -> str:
    """Module text for one `kda_fused` node (14 inputs, 3 outputs; see the module docstring).

    Raises UnsupportedError for a group that is not a single kda_fused node, or when `kda.emit_source` no longer
    has the shape this wrapper edits (its k3c.errors import and its `def launch(`).
    """
    node, ip, op = one_node(group, "kda_fused")
    a = node.attrs
    chunked = chunk_is_safe(a["gate"], a["lower_bound"])  # bounded gates only (kda_chunk docstring)
    spec = {"family": "prefill", "heads": a["heads"], "head_dim": a["head_dim"],
            "conv_size": int(node.inputs[6].type.shape[2]), "gate_kind": a["gate"],
            "lower_bound": float(a["lower_bound"]), "eps": float(a["eps"]), "ir_nodes": group.ir_nodes,
            "chunked": chunked}
    text = emit_source(spec)
    if text.count(_ERRORS_IMPORT) != 1 or text.count("\ndef launch(") != 1:
        raise UnsupportedError(f"{group.name}: kda.emit_source text changed; kda_abi cannot wrap it")
    text = text.replace(_ERRORS_IMPORT, _LOCAL_ERRORS).replace("\ndef launch(", "\ndef kda_family_launch(")
    if "k3c." in "".join(ln for ln in text.splitlines() if ln.lstrip().startswith(("import ", "from "))):
        raise UnsupportedError(f"{group.name}: the KDA kernel text imports k3c")
    lines = module_header(group, f"fused KDA mixer ({a['gate']} gate), decode/prefill by T", __name__,
                          takes_views=True)
    lines += [f"INPUT_POSITIONS = {ip!r}  # group inputs of (q, k, v, f, beta, gate, q_conv, k_conv, v_conv, "
              "A_log, dt_bias, o_norm, state, conv_state)",
              f"OUTPUT_POSITIONS = {op!r}  # group outputs of (y, state, conv_state)",
              f"CHUNKED = {chunked!r}  # gate safely bounded: prefill may use the {CHUNK}-token chunk kernel",
              f"CHUNK_MIN_TOKENS = {CHUNK}  # fewer tokens: token loop (as kda.kda_prefill, method='auto')", ""]
    return "\n".join(lines) + "\n" + text + _ABI_LAUNCH
