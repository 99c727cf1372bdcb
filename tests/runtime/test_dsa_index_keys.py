"""`--dsa-index-keys fp8` (`CompileContext.dsa_index_keys`): the DSA indexer's key cache stored as e4m3 keys with one
f32 scale per key, the appended keys quantized once (amax / 448), the indexer scoring e4m3 queries and keys.

Checked against an independent torch implementation (`_Fp8Indexer`: `models/k3.py`'s indexer with its keys and
queries quantized per row, written here from the definition, not from k3c's code):
- k3.1-pro-tiny: the compiled graphs (plan-only artifact, f32) interpreted by the reference interpreter, a 20-token
  prefill then decode steps at 20 and 21 cached keys (past the top-k of 16), against the patched eager model: the
  logits and the quantized caches; and the same eager model with exact keys differs (the option changes the
  selection: the comparison can fail);
- the artifact: the cache pools' dtypes, shapes and bytes in plan.json and schedule.json, the manifest and report
  options, a second compile byte-identical, the indexer launch reading both pools;
- the Triton launcher (interpreted) against `dsa_index_topk_ref`: the score kernel (prefill, short decode) and the
  radix select of decode at RADIX_MIN_KEYS keys;
- a compiled one-layer DSA model run by the runtime (Triton kernels interpreted): prefill then decode against the
  patched eager model (slow: `make test`);
- bad option values (ConfigError naming the option), and the CPU target's refusal (no TVM kernel scores e4m3 keys).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.codegen.triton import dsa_index  # noqa: E402
from k3c.codegen.triton.dsa_decode import radix_topk  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from k3c.context import DSA_RERANK_EXTRA, CompileContext  # noqa: E402
from k3c.errors import ConfigError, UnsupportedError  # noqa: E402
from k3c.frontend import import_model  # noqa: E402
from k3c.ir import serialize  # noqa: E402
from k3c.ir.interp import interpret  # noqa: E402
from k3c.ir.ops.model_attn import dsa_index_topk_ref, fp8_split_ref  # noqa: E402
from k3c.ir.types import evaluate, torch_dtype  # noqa: E402
from k3c.passes.derived import materialize_params  # noqa: E402
from models import layers  # noqa: E402
from models.config import _TINY_COMMON, K3Config, _shrink  # noqa: E402
from models.k3 import K3ForCausalLM, save_random_checkpoint  # noqa: E402

PRESET, B, PROMPT, STEPS = "k3.1-pro-tiny", 2, 20, 2     # top-k 16: prompt and decode steps past it
DSA_LAYERS = (3, 7, 9)                                   # k3.1-pro-tiny's DSA layers (0-based)
D_IDX = 16                                               # its index_head_dim


def _e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: (x8 as f32, scale [...]) with x ~= scale * x8, scale = max|row| / 448 (1 for a zero row)."""
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / scale[..., None]).to(torch.float8_e4m3fn).float(), scale


class _Fp8Indexer:
    """`layers.Indexer.forward` with FP8 keys: the cache keeps the exact keys (quantizing them again per call is
    quantizing once: the per-row quantization of a quantized row is itself), each call scores e4m3 keys against the
    e4m3 query (rounded to bf16 first, per head, its scale folded into the head weights)."""

    def __call__(self, mod, x, qr, cache, new_cache, prefix):
        Bn, T, _ = x.shape
        keys = torch.cat([cache[prefix + "index_k"], mod.k_norm(mod.wk(x))], 1)
        new_cache[prefix + "index_k"] = keys
        q = mod.wq_b(qr).reshape(Bn, T, mod.J, mod.Dk)
        w = mod.weights_proj(x) * (mod.J ** -0.5 * mod.Dk ** -0.5)
        q8, sq = _e4m3_rows(q.to(torch.bfloat16).float())
        k8, sk = _e4m3_rows(keys)
        score = torch.einsum("btj,btjs->bts", w * sq, torch.einsum("btjd,bsd->btjs", q8, k8).relu()) * sk[:, None]
        L = keys.shape[1]
        visible = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
        score = score.masked_fill(~visible, float("-inf"))
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :mod.topk]
        idx = torch.where(torch.isfinite(score.gather(-1, order)), order, -1)
        return torch.nn.functional.pad(idx, (0, max(0, mod.topk - L)), value=-1)


def _eager(model, tokens, cache, fp8: bool = True):
    """`model(tokens, cache)` without gradients, its indexer `_Fp8Indexer` (fp8) or the model's own (exact keys);
    patched for this call only (a compile exports the model's own)."""
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        if fp8:
            mp.setattr(layers.Indexer, "forward", lambda mod, *a: _Fp8Indexer()(mod, *a))
        return model(tokens, cache)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def plan_art(tmp_path_factory):
    """(options, artifact dir) of k3.1-pro-tiny compiled plan-only with FP8 index keys (f32)."""
    root = tmp_path_factory.mktemp("fp8keys")
    opts = CompileOptions(PRESET, root / "art", target="h200", dtype="f32", max_batch=B, max_seq=PROMPT + STEPS,
                          max_prefill=PROMPT, plan_only=True, dsa_index_keys="fp8")
    compile_model(opts)
    return opts, opts.out


def test_pools_manifest_and_determinism(plan_art):
    opts, path = plan_art
    plan = json.loads((path / "plan.json").read_text())
    sched = json.loads((path / "schedule.json").read_text())
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["extra"]["dsa_index_keys"] == "fp8"
    S = PROMPT + STEPS
    for i in DSA_LAYERS:
        keys, scales = plan["pools"][f"layers.{i}.index_k"], plan["pools"][f"layers.{i}.index_k_scale"]
        assert keys == {"shape": [B, S, D_IDX], "dtype": "f8e4m3", "bytes": B * S * D_IDX}
        assert scales == {"shape": [B, S], "dtype": "f32", "bytes": B * S * 4}
        assert plan["pools"][f"layers.{i}.kv"]["dtype"] == "f32"        # only the index keys change
    index_bytes = sum(p["bytes"] for k, p in plan["pools"].items() if ".index_k" in k)
    assert index_bytes == len(DSA_LAYERS) * B * S * (D_IDX + 4)          # vs D_IDX * 4 per key in f32
    for entry, e in sched.items():
        tops = [ln for ln in e["launches"] if ln["kind"] == "dsa_index_topk"]
        assert len(tops) == len(DSA_LAYERS), entry
        for ln in tops:       # the pools' appended views: e4m3 keys and f32 scales
            k, s = (e["values"][n] for n in ln["inputs"][2:])
            assert (k["dtype"], s["dtype"]) == ("f8e4m3", "f32"), entry
        appends = [ln for ln in e["launches"] if ln["kind"] == "cache_append"]
        assert {ln["inputs"][0] for ln in appends} >= {f"layers.{i}.index_k_scale" for i in DSA_LAYERS}
    again = CompileOptions(**{**vars(opts), "out": path.parent / "again"})
    compile_model(again)
    for rel in ("plan.json", "schedule.json", "graph/prefill.json", "graph/decode.json", "manifest.json"):
        assert (again.out / rel).read_bytes() == (path / rel).read_bytes(), rel


def test_interpreted_graphs_match_eager_with_fp8_keys(plan_art):
    """The artifact's own graphs (every pass run) through the reference interpreter: prefill, then decode steps on
    the caches it returns, against eager with `_Fp8Indexer`: logits within 1e-5 of max |logit| (f32), the caches
    equal to eager's keys quantized (>= 99 % of the e4m3 bytes, the rest one step off at a rounding boundary of an
    f32 sum in another order); eager with exact keys is farther than 1e-3 from both."""
    _, path = plan_art
    cfg = K3Config.from_pretrained(PRESET)
    model = K3ForCausalLM(cfg).init_random_(1).eval()
    named = {k: p.detach() for k, p in model.named_parameters()}
    graphs = {e: serialize.load(path / "graph" / f"{e}.json") for e in ("prefill", "decode")}
    params = {e: materialize_params(g, named) for e, g in graphs.items()}
    tokens = torch.randint(0, cfg.vocab_size, (B, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    caches = {v.name: torch.zeros([evaluate(d, {"B": B, "L": 0}) for d in v.type.shape], dtype=torch_dtype(v.type.dtype))
              for v in graphs["prefill"].inputs if v.name != "tokens"}
    eager_cache, exact_cache, worst_exact = model.new_cache(B), model.new_cache(B), 0.0
    for t0, t1 in [(0, PROMPT)] + [(PROMPT + s, PROMPT + s + 1) for s in range(STEPS)]:
        entry = "prefill" if t0 == 0 else "decode"
        out = interpret(graphs[entry], {"tokens": tokens[:, t0:t1], **caches}, params[entry],
                        bindings={"B": B, "T": t1 - t0, "L": t0})
        caches = {k: out[k] for k in caches}
        logits, eager_cache = _eager(model, tokens[:, t0:t1], eager_cache)
        exact, exact_cache = _eager(model, tokens[:, t0:t1], exact_cache, fp8=False)
        assert _rel(out["logits"][:, -1], logits[:, -1]) < 1e-5, (entry, t0)
        worst_exact = max(worst_exact, _rel(exact[:, -1], logits[:, -1]))
        for i in DSA_LAYERS:
            k8, scale = _e4m3_rows(eager_cache[f"layers.{i}.index_k"])
            got8, got_scale = caches[f"layers.{i}.index_k"], caches[f"layers.{i}.index_k_scale"]
            assert got8.dtype == torch.float8_e4m3fn and got8.shape == (B, t1, D_IDX)
            assert (got8.float() == k8).float().mean() >= 0.99, (entry, t0, i)
            assert (got8.float() - k8).abs().max() <= k8.abs().amax() * 2 ** -3, (entry, t0, i)
            assert _rel(got_scale, scale) < 1e-5, (entry, t0, i)
    assert worst_exact > 1e-3      # FP8 keys select other keys than exact ones here: the checks above can fail


def _launch_and_ref(T: int, L: int, D: int = 16):
    """(launcher's idx, `dsa_index_topk_ref`'s, the ref's with the exact (unquantized) query), each sorted per row,
    for random q, w and e4m3 keys of batch 2, 4 heads of D, top-16."""
    gen = torch.Generator().manual_seed(T + L)
    Bn, J, topk = 2, 4, 16
    q = torch.randn(Bn, T, J, D, generator=gen)
    w = torch.randn(Bn, T, J, generator=gen)
    k8, scale = _quantize(torch.randn(Bn, L, D, generator=gen))
    out = torch.empty(Bn, T, topk, dtype=torch.int64)
    dsa_index.launch_dsa_index_topk(q, w, k8, out, topk=topk, k_scale=scale)
    (want,) = dsa_index_topk_ref({"topk": topk}, q, w, k8, scale)
    s = torch.einsum("btj,btjs->bts", w, torch.einsum("btjd,bsd->btjs", q, k8.float()).relu()) * scale[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > torch.arange(L - T, L)[:, None], float("-inf"))
    exact = s.topk(topk, dim=-1).indices
    return out.sort(-1).values, want.sort(-1).values, exact.sort(-1).values


@pytest.mark.parametrize("T,L,D,radix", [(6, 40, 16, False), (1, 2000, 16, False),
                                         (1, dsa_index.RADIX_MIN_KEYS, dsa_index.FP8_RADIX_MIN_D, True),
                                         (1, dsa_index.RADIX_MIN_KEYS, 16, False)],
                         ids=["prefill", "decode-score-kernel", "decode-radix", "decode-narrow-keys"])
def test_launcher_matches_the_reference(T, L, D, radix, monkeypatch):
    """`launch_dsa_index_topk` with e4m3 keys (interpreted Triton) selects the set `dsa_index_topk_ref` selects, on
    the score kernel (T > 1, or few keys, or keys narrower than the radix scan's e4m3 product takes) and on the
    radix select of long-context decode."""
    calls = []
    monkeypatch.setattr(dsa_index, "radix_topk", lambda *a, **k: calls.append(1) or radix_topk(*a, **k))
    got, want, _ = _launch_and_ref(T, L, D)
    assert torch.equal(got, want) and bool(calls) == radix


@pytest.mark.parametrize("T,L,D,radix", [(6, 40, 16, False), (1, 2048, 32, True)], ids=["prefill", "decode-radix"])
def test_launcher_rerank_matches_the_reference(T, L, D, radix, monkeypatch):
    """fp8-rerank keys (`fp8_split_ref`, E = 8 extra candidates): `launch_dsa_index_topk` on scratch of the planned
    sizes (`dsa_index_topk_scratch`) filled with garbage selects the set `dsa_index_topk_ref` selects, on the score
    kernel and (RADIX_MIN_KEYS lowered to the row) on the radix select, both then re-ranked by `dsa_rerank`; fp8
    alone selects another set."""
    monkeypatch.setattr(dsa_index, "RADIX_MIN_KEYS", 2048)
    calls = []
    monkeypatch.setattr(dsa_index, "radix_topk", lambda *a, **k: calls.append(1) or radix_topk(*a, **k))
    gen = torch.Generator().manual_seed(T + L)
    Bn, J, topk, extra = 2, 4, 16, 8
    q, w = torch.randn(Bn, T, J, D, generator=gen), torch.randn(Bn, T, J, generator=gen)
    k8, scale, lo = fp8_split_ref({}, torch.randn(Bn, L, D, generator=gen))
    out = torch.empty(Bn, T, topk, dtype=torch.int64)
    n_keys = max(Bn * L + Bn * dsa_index.RADIX_ROW_PAD, min(dsa_index.SCRATCH_BYTES // 8, Bn * T * L))
    scratch = {"keys": torch.full((n_keys,), -7, dtype=torch.int64),
               "rerank": torch.full((2 * Bn * T * (topk + extra),), -7, dtype=torch.int64)}
    dsa_index.launch_dsa_index_topk(q, w, k8, out, topk=topk, k_scale=scale, k_lo=lo, rerank_extra=extra,
                                    scratch=scratch)
    (want,) = dsa_index_topk_ref({"topk": topk, "rerank": extra}, q, w, k8, scale, lo)
    (plain,) = dsa_index_topk_ref({"topk": topk}, q, w, k8, scale)
    assert torch.equal(out.sort(-1).values, want.sort(-1).values) and bool(calls) == radix
    assert not torch.equal(plain.sort(-1).values, want.sort(-1).values)


def test_the_query_is_e4m3_too():
    """Where the e4m3 query moves the selection (the prefill case above), the launcher follows the reference's
    e4m3 query, not the exact one."""
    got, want, exact = _launch_and_ref(6, 40)
    assert torch.equal(got, want) and not torch.equal(got, exact)


def _quantize(x):
    """x [..., D] -> (float8_e4m3fn, f32 scale [...]), contiguous (`_e4m3_rows`)."""
    x8, scale = _e4m3_rows(x)
    return x8.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def test_bad_values_and_tvm_refusal(plan_art):
    with pytest.raises(ConfigError, match=r"^--dsa-index-keys fp4 \(dsa_index_keys\): expected one of bf16, fp8, "
                                          r"fp8-rerank$"):
        CompileContext(dsa_index_keys="fp4")
    with pytest.raises(ConfigError, match=r"--dsa-index-keys e4m3 \(dsa_index_keys\)"):
        import_model(PRESET, "decode", dsa_index_keys="e4m3")
    opts, path = plan_art       # the CPU target's kernels are TVM's, which score bf16/f32 keys only
    with pytest.raises(UnsupportedError, match=r"^no backend implements dsa_index_topk .* backends in claim order: "
                                               r"tvm, library.*; tvm: it has no e4m3 \(fp8\) kernels: fp8 DSA index "
                                               r"keys \(--dsa-index-keys fp8 / fp8-rerank\) need a GPU target"):
        compile_model(CompileOptions(**{**vars(opts), "out": path.parent / "cpu", "target": "cpu-x86-64"}))
    mla = path.parent / "mla"   # a model without DSA layers has no index-key cache: refused before anything is written
    with pytest.raises(ConfigError, match=r"^--dsa-index-keys fp8-rerank \(dsa_index_keys\): k3-tiny has no DSA "
                                          r"layers \(config: dsa_config\.dsa_layers\)"):
        compile_model(CompileOptions("k3-tiny", mla, plan_only=True, dsa_index_keys="fp8-rerank"))
    assert not mla.exists()


def _one_dsa_layer() -> K3Config:
    """K3.1 Pro's structure at the smallest size with one layer: a DSA layer (top-k 16) and a dense MLP."""
    over = dict(_TINY_COMMON, num_hidden_layers=1, vocab_size=64, q_lora_rank=32, routed_expert_hidden_size=32,
                attn_res_block_size=2, num_shared_experts=1)
    return _shrink("dsa-fp8-tiny", "k3.1-pro", linear_attn_config=dict(kda_layers=[], full_attn_layers=[1],
                                                                        num_heads=4, head_dim=16),
                   dsa_config=dict(index_num_heads=4, index_head_dim=16, index_topk=16, dsa_layers=[1]), **over)


@pytest.mark.slow   # compiles an artifact and interprets its kernels: `make test`, not `make test-quick`
def test_compiled_prefill_then_decode_match_eager(tmp_path):
    """A one-layer DSA model compiled for the h200 target (Triton kernels, interpreted), batch 1: a 17-token prefill
    (the score kernel, keys past the top-k) then decode steps, against eager with `_Fp8Indexer` (1e-4 of max
    |logit|, f32), and the pools' e4m3 keys against eager's keys quantized."""
    model = save_random_checkpoint(_one_dsa_layer(), tmp_path / "ckpt", seed=4, dtype=torch.float32).eval()
    opts = CompileOptions(str(tmp_path / "ckpt"), tmp_path / "art", target="h200", dtype="f32", max_batch=1,
                          max_seq=19, max_prefill=17, dsa_index_keys="fp8")
    compile_model(opts)
    session = k3c.load(opts.out, "cpu")
    tokens = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(1)
    for i, (t0, t1) in enumerate([(0, 17), (17, 18), (18, 19)]):
        got = session.prefill(tokens[:, t0:t1])[:, -1] if i == 0 else session.decode(tokens[:, t0:t1])[:, 0]
        logits, cache = _eager(model, tokens[:, t0:t1], cache)
        assert _rel(got, logits[:, -1]) < 1e-4, i
        k8, scale = _e4m3_rows(cache["layers.0.index_k"])
        pool, pool_scale = session.pools["layers.0.index_k"][:, :t1], session.pools["layers.0.index_k_scale"][:, :t1]
        assert (pool.float() == k8).float().mean() >= 0.99 and _rel(pool_scale, scale) < 1e-5, i


def _split_join(x: torch.Tensor) -> torch.Tensor:
    """Keys as `--dsa-index-keys fp8-rerank` stores them, joined again, from the option's definition (float64): per
    row the scale 2^(floor(log2 max|x|) - 7); y = x / scale rounded to the e4m3 grid (spacing s = 2^(max(floor(log2
    |y|), -6) - 3) in y's binade) to nearest, ties upward; the rest in units of s / 16, rounded to nearest even and
    clamped to [-8, 7]."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax)) - 7), torch.ones_like(amax))
    y = x / scale
    s = torch.exp2(torch.clamp(torch.floor(torch.log2(y.abs())), min=-6) - 3)
    lower, upper = torch.floor(y / s) * s, torch.ceil(y / s) * s
    hi = torch.where(y - lower < upper - y, lower, upper)
    return (hi + torch.round((y - hi) / (s / 16)).clamp(-8, 7) * s / 16) * scale


class _RerankIndexer:
    """`layers.Indexer.forward` with fp8-rerank keys on contexts of at most topk + E keys, where every visible key
    is a candidate: the exact scores of the joined keys (`_split_join`), the query as the model computes it."""

    def __call__(self, mod, x, qr, cache, new_cache, prefix):
        Bn, T, _ = x.shape
        keys = torch.cat([cache[prefix + "index_k"], mod.k_norm(mod.wk(x))], 1)
        new_cache[prefix + "index_k"] = keys
        L = keys.shape[1]
        assert L <= mod.topk + DSA_RERANK_EXTRA
        q = mod.wq_b(qr).reshape(Bn, T, mod.J, mod.Dk)
        w = mod.weights_proj(x) * (mod.J ** -0.5 * mod.Dk ** -0.5)
        score = torch.einsum("btj,btjs->bts", w, torch.einsum("btjd,bsd->btjs", q, _split_join(keys).float()).relu())
        visible = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
        score = score.masked_fill(~visible, float("-inf"))
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :mod.topk]
        idx = torch.where(torch.isfinite(score.gather(-1, order)), order, -1)
        return torch.nn.functional.pad(idx, (0, max(0, mod.topk - L)), value=-1)


def test_fp8_rerank_artifact_matches_eager(tmp_path):
    """`--dsa-index-keys fp8-rerank` on a one-layer DSA model (top-k 16), plan-only, f32: the pools (e4m3 keys, f32
    scales, u8 residuals: D + 4 + D / 2 bytes per token), and the artifact's graphs through the reference
    interpreter (a 17-token prefill, then decode steps at 17 and 18 keys) against eager with `_RerankIndexer`:
    logits within 1e-5 of max |logit|, the pools' keys joined (e4m3 + nibbles x the grid spacing / 16 of the binade
    the nibble points into, x scale) equal to `_split_join` of eager's keys."""
    cfg = _one_dsa_layer()
    model = save_random_checkpoint(cfg, tmp_path / "ckpt", seed=4, dtype=torch.float32).eval()
    opts = CompileOptions(str(tmp_path / "ckpt"), tmp_path / "art", target="h200", dtype="f32", max_batch=1,
                          max_seq=19, max_prefill=17, plan_only=True, dsa_index_keys="fp8-rerank")
    compile_model(opts)
    pools = json.loads((opts.out / "plan.json").read_text())["pools"]
    assert [(pools[f"layers.0.index_k{s}"]["dtype"], pools[f"layers.0.index_k{s}"]["bytes"])
            for s in ("", "_scale", "_lo")] == [("f8e4m3", 19 * D_IDX), ("f32", 19 * 4), ("u8", 19 * D_IDX // 2)]
    graphs = {e: serialize.load(opts.out / "graph" / f"{e}.json") for e in ("prefill", "decode")}
    named = {k: p.detach() for k, p in model.named_parameters()}
    params = {e: materialize_params(g, named) for e, g in graphs.items()}
    tokens = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(5))
    caches = {v.name: torch.zeros([evaluate(d, {"B": 1, "L": 0}) for d in v.type.shape], dtype=torch_dtype(v.type.dtype))
              for v in graphs["prefill"].inputs if v.name != "tokens"}
    cache = model.new_cache(1)
    for t0, t1 in [(0, 17), (17, 18), (18, 19)]:
        out = interpret(graphs["prefill" if t0 == 0 else "decode"], {"tokens": tokens[:, t0:t1], **caches},
                        params["prefill" if t0 == 0 else "decode"], bindings={"B": 1, "T": t1 - t0, "L": t0})
        caches = {k: out[k] for k in caches}
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(layers.Indexer, "forward", lambda mod, *a: _RerankIndexer()(mod, *a))
            logits, cache = model(tokens[:, t0:t1], cache)
        assert _rel(out["logits"][:, -1], logits[:, -1]) < 1e-5, t0
        k8, scale, lo = (caches[f"layers.0.index_k{s}"] for s in ("", "_scale", "_lo"))
        nib = torch.stack([lo.long() & 15, lo.long() >> 4], -1).flatten(-2) - 8
        hi = k8.double()
        spacing = torch.exp2(torch.clamp(torch.floor(torch.log2(hi.abs())), min=-6) - 3)     # of hi's binade, or
        below = (nib != 0) & ((nib < 0) != (hi < 0)) & (hi.abs() == spacing * 8) & (hi.abs() >= 2 ** -5)
        joined = (hi + nib * torch.where(below, spacing / 2, spacing) / 16) * scale.double()[..., None]   # below it
        want = _split_join(cache["layers.0.index_k"])
        assert joined.shape == (1, t1, D_IDX) and (joined == want).double().mean() >= 0.99, t0
        assert ((joined - want).abs() <= want.abs().amax(-1, keepdim=True) * 2 ** -8).all(), t0
