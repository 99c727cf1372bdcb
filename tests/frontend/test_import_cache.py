"""The on-disk import memo (`k3c.frontend.cache`): a hit gives the graph the importer gives, so a compile is the
same with or without it; a changed config, parameter dtype or importing code misses; a damaged file is rebuilt."""

from __future__ import annotations

import pytest
import torch

from k3c.context import CompileContext
from k3c.frontend import build_meta_model, cache, import_model
from k3c.ir import serialize
from k3c.passes.pipeline import run_pipeline


@pytest.fixture
def memo(tmp_path, monkeypatch):
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "memo"))
    return tmp_path / "memo"


def _files(memo):
    return sorted(memo.glob("import-*.json"))


def _import(model, entry="prefill"):
    stats: dict = {}
    return import_model(model, entry, stats=stats), stats


def test_hit_is_the_imported_graph_and_compiles_the_same(memo, monkeypatch):
    monkeypatch.setenv("K3C_CACHE_DIR", "off")
    fresh = {e: import_model("k3-tiny", e) for e in ("prefill", "decode")}
    monkeypatch.setenv("K3C_CACHE_DIR", str(memo))
    for entry in ("prefill", "decode"):
        g1, s1 = _import("k3-tiny", entry)
        g2, s2 = _import("k3-tiny", entry)
        assert (s1["cached"], s2["cached"]) == (entry == "decode", True)  # decode specialises the memoised prefill
        assert serialize.dumps(g1) == serialize.dumps(g2) == serialize.dumps(fresh[entry])
    assert len(_files(memo)) == 2
    ctx = CompileContext(max_batch=2, max_seq=64, max_prefill=16).for_entry("prefill")
    compiled = [serialize.dumps(run_pipeline(g, ctx=ctx)[0]) for g in (fresh["prefill"], _import("k3-tiny")[0])]
    assert compiled[0] == compiled[1]


def test_config_params_and_code_are_in_the_key(memo, monkeypatch):
    _import("k3-tiny")
    model = build_meta_model("k3-tiny")
    assert _import(model)[1]["cached"] is False  # a module keys on its parameters' types, not "meta"
    assert _import(model)[1]["cached"] is True
    monkeypatch.setattr(cache, "code_digest", lambda: "an edited importer")
    assert _import("k3-tiny")[1]["cached"] is False
    assert len(_files(memo)) == 3
    raw, params = model.config.raw, [("w", "torch.float32", [2, 3])]
    base = cache.key(raw, "k3-tiny", params, "prefill", "all")
    assert len({base, cache.key({**raw, "hidden_size": 1}, "k3-tiny", params, "prefill", "all"),
                cache.key(raw, "k3-tiny", [("w", "torch.bfloat16", [2, 3])], "prefill", "all"),
                cache.key(raw, "k3-tiny", params, "decode", "all"), cache.key(raw, "k3-tiny", params, "prefill", "last"),
                cache.key(raw, "k3-tiny", "meta", "prefill", "all")}) == 6


def test_damaged_file_is_imported_again(memo):
    _import("k3-tiny")
    (path,) = _files(memo)
    path.write_text(path.read_text()[:1000])
    g, stats = _import("k3-tiny")
    assert stats["cached"] is False and serialize.dumps(g) == path.read_text()


def test_off_writes_nothing(memo, monkeypatch):
    monkeypatch.setenv("K3C_CACHE_DIR", "off")
    assert _import("k3-tiny")[1]["cached"] is False and not memo.exists()
