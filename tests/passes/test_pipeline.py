import pytest
import torch

from k3c.errors import IRError
from k3c.ir import Graph, TensorType
from k3c.passes import pipeline
from k3c.passes.pipeline import make_numeric_check, random_inputs, register_pass, run_pipeline


def model_like() -> Graph:
    g = Graph()
    ids = g.add_input("tokens", TensorType(("B", "T"), "i64"))
    emb = g.add_param("model.embed_tokens.weight", TensorType((11, 8), "f32"))
    w = g.add_param("lm_head.weight", TensorType((11, 8), "f32"))
    h = g.add("embedding", emb, ids)
    h1 = g.add("rms_norm", h, eps=1e-6)
    h2 = g.add("rms_norm", h, eps=1e-6)  # duplicate: cse
    g.add("exp", h)  # dead: dce
    g.set_output("logits", g.add("linear", g.add("add", h1, h2), w))
    return g


@pytest.fixture
def scratch_passes(monkeypatch):
    """Register test-only passes and phases without leaking them into other tests."""
    monkeypatch.setattr(pipeline, "_PASSES", dict(pipeline._PASSES))
    monkeypatch.setattr(pipeline, "PHASES", dict(pipeline.PHASES))
    return pipeline


def test_cleanup_phase_dumps_and_reports(tmp_path):
    g = model_like()
    out, report = run_pipeline(g, {"cleanup": ["dce", "cse"]}, dump_dir=tmp_path)
    assert [r.name for r in report.passes] == ["dce", "cse"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00-input.txt", "01-dce.txt", "02-cse.txt"]
    assert "exp(" in (tmp_path / "00-input.txt").read_text()
    assert "exp(" not in (tmp_path / "01-dce.txt").read_text()
    assert (tmp_path / "02-cse.txt").read_text().count("rms_norm(") == 1
    assert len(out.nodes) == 4 and len(g.nodes) == 6  # the caller's graph is untouched
    assert "dce" in report.table()


def test_env_dump_and_until(tmp_path, monkeypatch):
    monkeypatch.setenv("K3C_DUMP", str(tmp_path))
    _, report = run_pipeline(model_like(), {"cleanup": ["dce", "cse"]}, until="dce")
    assert [r.name for r in report.passes] == ["dce"]
    assert (tmp_path / "01-dce.txt").exists() and not (tmp_path / "02-cse.txt").exists()


def test_numeric_check_names_the_broken_pass(scratch_passes):
    @register_pass("break_norm")
    def break_norm(g, ctx):
        for n in g.nodes:
            if n.op == "rms_norm":
                n.attrs["eps"] = 10.0  # still well typed, numerically wrong
        return g

    check = make_numeric_check({"B": 2, "T": 3})
    run_pipeline(model_like(), {"cleanup": ["dce", "cse"]}, numeric_check=check)  # correct passes: fine
    with pytest.raises(IRError, match="pass break_norm changed output 'logits'"):
        run_pipeline(model_like(), {"cleanup": ["dce", "cse"], "model": ["break_norm"]}, numeric_check=check)


def test_verifier_runs_after_every_pass(scratch_passes):
    @register_pass("break_types")
    def break_types(g, ctx):
        g.nodes[0].outputs[0].type = TensorType(("B", "T", 9), "f32")
        return g

    with pytest.raises(IRError, match="after pass break_types: embedding"):
        run_pipeline(model_like(), {"model": ["break_types"]})


def test_verify_end_checks_the_result_only(scratch_passes):
    @register_pass("break_types")
    def break_types(g, ctx):
        g.nodes[0].outputs[0].type = TensorType(("B", "T", 9), "f32")
        return g

    @register_pass("fix_types")
    def fix_types(g, ctx):
        g.nodes[0].outputs[0].type = TensorType(("B", "T", 8), "f32")
        return g

    with pytest.raises(IRError, match="after the pipeline: embedding.*verify='each' names the pass"):
        run_pipeline(model_like(), {"model": ["break_types"]}, verify="end")
    run_pipeline(model_like(), {"model": ["break_types", "fix_types"]}, verify="end")  # broken in between: not seen
    run_pipeline(model_like(), {"model": ["break_types"]}, verify="off")
    with pytest.raises(IRError, match="verify=True"):
        run_pipeline(model_like(), {"model": []}, verify=True)


def test_register_twice_is_an_error(scratch_passes):
    register_pass("dup")(lambda g: g)
    with pytest.raises(IRError, match="registered twice"):
        @register_pass("dup")
        def other(g, ctx):
            return g


def test_random_inputs_respect_index_bounds_and_seed():
    g = model_like()
    ins, params = random_inputs(g, {"B": 2, "T": 50}, seed=3)
    assert ins["tokens"].max() < 11 and ins["tokens"].dtype == torch.int64
    assert params["lm_head.weight"].shape == (11, 8)
    ins2, _ = random_inputs(g, {"B": 2, "T": 50}, seed=3)
    assert torch.equal(ins["tokens"], ins2["tokens"])


def test_unknown_pass_is_an_error_naming_the_registered_ones():
    with pytest.raises(IRError, match=r"no pass named 'not_written_yet' \(registered: .*canonicalize.*\)"):
        run_pipeline(model_like(), {"cleanup": ["dce", "not_written_yet"]})
