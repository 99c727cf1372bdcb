"""CompileContext (the one way options reach passes) and the backend claim order."""

from __future__ import annotations

import dataclasses

import pytest

from k3c.codegen.backend import backends_for, claim_order
from k3c.context import CompileContext, bounds_bindings
from k3c.errors import ArtifactError, ConfigError
from k3c.runtime.launchers import make_launchers
from k3c.targets import load_target


def test_bounds_per_entry():
    ctx = CompileContext(max_batch=4, max_seq=4096, max_prefill=512)
    assert ctx.for_entry("prefill").bounds == {"B": 4, "T": 512, "L": 3584}
    assert ctx.for_entry("decode").bounds == {"B": 4, "T": 1, "L": 4095}
    assert ctx.bounds_json == {"max_batch": 4, "max_seq": 4096, "max_prefill": 512}
    assert bounds_bindings("decode", 1, 1, 1) == {"B": 1, "T": 1, "L": 0}


@pytest.mark.parametrize("kw,field", [({"dtype": "f16"}, "--dtype"), ({"tp": 0}, "--tp"), ({"ep": -1}, "--ep"),
                                      ({"max_prefill": 9, "max_seq": 8}, "--max-prefill"),
                                      ({"max_batch": 0}, "--max-batch"), ({"tp": 2, "rank": 2}, "rank"),
                                      ({"kda_state_dtype": "fp8"},
                                       r"^--kda-state fp8 \(kda_state_dtype\): expected one of f32, bf16$")])
def test_bad_options_name_the_flag(kw, field):
    with pytest.raises(ConfigError, match=field):
        CompileContext(**kw)
    with pytest.raises(ConfigError, match="entry"):
        CompileContext().for_entry("train")


def test_claim_order_follows_the_target_and_the_preference():
    assert claim_order(load_target("h200")) == ("triton", "library", "view", "collective")
    with pytest.raises(ConfigError, match="--backend library: expected a code-generating backend"):
        claim_order(load_target("h200"), "library")
    with pytest.raises(ConfigError, match=r"--backend cuda-magic: expected a code-generating backend \(triton, tvm\)"):
        claim_order(load_target("h200"), "cuda-magic")
    chip = dataclasses.replace(load_target("h200"), name="chip", backends=("triton", "nosuch"))
    with pytest.raises(ConfigError, match="target chip: field 'backends': unknown backend 'nosuch' \\(known: "):
        claim_order(chip)
    names = [b.name for b in CompileContext(target="h200").resolve().backends]
    assert names == [b.name for b in backends_for(load_target("h200"))]


def test_runtime_refuses_an_unknown_backend():
    schedule = {"decode": {"launches": [{"name": "k0", "backend": "quantum", "kind": "x", "inputs": [],
                                         "outputs": []}]}}
    with pytest.raises(ArtifactError, match="backend 'quantum'"):
        make_launchers(None, None, schedule, None)
