"""Sizes, backends and layouts of the artifacts the runtime tests share (compiled once per session: conftest.py).

Sizes: the end-to-end tests run the interpreter on the fewest tokens that still cross every chunk and top-k
boundary of the tiny presets' kernels and of the runtime (interpreted cost grows with batch x tokens, and a
token-loop prefill is dearer per token than a chunked one):
- MAX_PREFILL = 24, PROMPT = 30: `Session.prefill` splits the prompt into calls of 24 and 6 tokens. The 24-token
  call runs the chunked KDA kernel on a full 16-token chunk and a partial one (CHUNK = 16,
  k3c/codegen/triton/kda.py); the 6-token call (< CHUNK) runs the token-loop form on a cached context of 24.
- keys reach 31..33 tokens: past DSA's top-k of 16 (k3.1-pro-tiny `index_topk`: the sparse selection is live for
  most queries) and past the f32 attention key block of 32 (k3c/codegen/triton/attention.py BLOCK_S).
- STEPS = 3 decode steps: the decode entry point with pool appends at three context lengths.
- batch 1 and 2 below the compiled MAX_BATCH = 3: one sequence, and several rows that differ per program (its
  cost grows with the batch: 2 rows cost 2/3 of 3; the prefill calls' MoE row counts, 96 and 24, still leave a
  masked tail in the expert schedule kernel's power-of-two row block, as 3 decode rows would: test_end_to_end.py).
Every preset runs prefill + decode on every backend in BACKENDS, at batch 1, or 2 for the MXFP4 preset (the one
with every model kernel: test_end_to_end.py).

Native (TVM, `cpu-x86-64`) artifacts run fast enough for the acceptance lengths: test_tvm_end_to_end.py prefills
TVM_PROMPT = 64 tokens and decodes TVM_STEPS = 32, and the tensor-parallel test compares TP = 2 and 4 with those TP = 1
artifacts over the PROMPT-token prompt above (prefilled in calls of MAX_PREFILL, so the collectives run at 24 and 6
tokens: 6 rows do not split evenly over 4 ranks) and TP_STEPS = 32 decode steps.
"""

from __future__ import annotations

#: code generators the end-to-end tests run on CPU (the lead adds "tvm" when the TVM CPU backend lands)
BACKENDS = ["triton"]
PROMPT, MAX_PREFILL, STEPS, MAX_BATCH = 30, 24, 3, 3
#: the preset whose checkpoint stores MXFP4 routed experts (like the published K3 / K3.1 Pro ones); others are dense
MXFP4_PRESET = "k3.1-pro-tiny"
MAX_SEQ = PROMPT + STEPS
TVM_PROMPT, TVM_STEPS = 64, 32
TP_STEPS = 32
#: the tensor-parallel test's worlds (ranks): every tiny preset is compiled and run at each
TP_WORLDS = (2, 4)


def tp_ep(preset: str, tp: int) -> int:
    """`--ep` of the tensor-parallel artifacts: the MXFP4 preset's experts are partitioned over the ranks (a width
    split would cut its 32-value scale groups); the dense presets' are split over their width (1)."""
    return tp if preset == MXFP4_PRESET else 1
