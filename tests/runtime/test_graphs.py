"""Whole-step CUDA graphs for decode (`k3c.runtime.graphs`): which launches depend on the context and read it from
device memory (CPU), and that replaying the graph gives the logits of eager execution (GPU)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from k3c.compile import CompileOptions, compile_model
from k3c.runtime.graphs import device_lengths_supported, length_dependent
from models.config import TINY_PRESETS, K3Config
from models.k3 import save_random_checkpoint


def _plan_only(preset: str, out, target: str = "h200"):
    compile_model(CompileOptions(preset, out, target=target, max_batch=2, max_seq=64, max_prefill=16, plan_only=True))
    return json.loads((out / "schedule.json").read_text())["decode"]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_context_dependent_launches_read_device_lengths(preset, tmp_path):
    cfg = K3Config.from_pretrained(preset)
    sched = _plan_only(preset, tmp_path / "art")
    dep = length_dependent(sched)
    launches = sched["launches"]
    kinds = [ln["kind"] for ln, d in zip(launches, dep) if d]
    attn_layers = sum(cfg.layer_kind(i) != "kda" for i in range(cfg.num_hidden_layers))
    dsa_layers = sum(cfg.layer_kind(i) == "dsa" for i in range(cfg.num_hidden_layers))
    # per global-attention layer: the attention and its latent-KV append; per DSA layer also the indexer and its
    # index-key append. Everything else (KDA, MoE, AttnRes, norms, GEMMs) has shapes fixed by the batch alone.
    assert sorted(kinds) == sorted(["mla_attention", "cache_append"] * attn_layers
                                   + ["dsa_index_topk", "cache_append"] * dsa_layers)
    mentions_l = re.compile(r"\bL\b")
    for ln, d in zip(launches, dep):
        dims = [x for v in (*ln["inputs"], *ln["outputs"]) for x in sched["values"].get(v, {}).get("shape", [])]
        if any(isinstance(x, str) and mentions_l.search(x) for x in dims):
            assert d, f"{ln['name']} depends on L but is not marked"
    assert device_lengths_supported(sched)  # Triton attention / indexer, view appends: one graph per step


def test_tvm_kernels_take_host_lengths(tmp_path):
    # TVM's CPU kernels take L as an integer: such an artifact decodes with host lengths (and no CUDA graphs)
    sched = _plan_only("k3-tiny", tmp_path / "art", target="cpu-x86-64")
    assert any(ln["backend"] == "tvm" and ln["kind"] == "mla_attention" for ln in sched["launches"])
    assert not device_lengths_supported(sched)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_graph_replay_matches_eager_decode(tmp_path, dtype):
    import k3c

    save_random_checkpoint(K3Config.from_pretrained("k3.1-pro-tiny"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    opts = CompileOptions(str(tmp_path / "ckpt"), tmp_path / "art", target="h200", max_batch=2, max_seq=64,
                          max_prefill=32, dtype=dtype)
    compile_model(opts)
    plain, graphed = k3c.load(opts.out, "cuda", cuda_graphs=False), k3c.load(opts.out, "cuda")
    tokens = torch.randint(0, plain.vocab, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    want, got = plain.prefill(tokens), graphed.prefill(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    nxt = want[:, -1:].argmax(-1)
    for step in range(8):  # the first step runs eagerly and captures; the next ones replay
        want, got = plain.decode(nxt), graphed.decode(nxt)
        assert graphed.last_timing["cuda_graphs"] == (step > 0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        nxt = want.argmax(-1)
    assert graphed.lengths[:2].tolist() == [24 + 8] * 2  # the in-graph increment kept the device lengths
    # greedy generation: the graph that takes its own argmax as the next input gives the tokens of the host loop
    got = graphed.generate(nxt, 6)
    want = [plain.decode(nxt).argmax(-1)]
    for _ in range(5):
        want.append(plain.decode(want[-1]).argmax(-1))
    assert got.tolist() == torch.cat(want, 1).tolist() and graphed.last_timing["cuda_graphs"]
    assert graphed.length == plain.length == 24 + 8 + 6 and graphed.lengths[:2].tolist() == [24 + 8 + 6] * 2


@pytest.mark.slow
def test_generate_is_the_greedy_decode_loop(compiled):
    """`Session.generate` on CPU (each step a decode call) gives the greedy tokens of the fp32 reference model
    (models/k3.py: prefill, then the first token fed back), whose top-2 logits are well apart at both steps."""
    import k3c
    from k3c.errors import RuntimeInputError

    _, art, model = compiled("kimi-linear-tiny")
    s = k3c.load(art, "cpu")
    prompt = torch.randint(0, s.vocab, (1, 3), generator=torch.Generator().manual_seed(1))
    got = s.generate(prompt, 2)
    assert s.length == 3 + 1  # the last generated token is not fed back
    with torch.no_grad():
        logits, cache = model(prompt)
        want = [logits[:, -1:].argmax(-1)]
        logits2, _ = model(want[0], cache)
        want.append(logits2[:, -1:].argmax(-1))
    for lg in (logits, logits2):  # a margin far above the artifact's 1e-4 agreement: the argmax cannot flip
        top2 = lg[0, -1].topk(2).values
        assert top2[0] - top2[1] > 1e-2 * lg.abs().max()
    assert got.tolist() == torch.cat(want, 1).tolist()
    with pytest.raises(RuntimeInputError, match="steps"):
        s.generate(prompt, 0)
    with pytest.raises(RuntimeInputError, match="max_seq"):
        s.generate(prompt, s.max_seq)
    assert s.length == 3 + 1  # refused before anything ran
