"""The command line's start-up: `k3c --help`, `--version` and argument errors answer without importing torch or
the compiler (the CLI imports them inside the commands, after the arguments are checked)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import k3c

ROOT = Path(__file__).resolve().parents[1]
# run the CLI, then list which heavy modules the process imported
PROBE = """
import sys, k3c.cli
sys.argv = ["k3c", *sys.argv[1:]]
try:
    k3c.cli.main()
except SystemExit as e:
    code = e.code
else:
    code = 0
print("HEAVY", sorted(m for m in ("torch", "k3c.compile", "k3c.frontend") if m in sys.modules), code)
"""


def probe(*args: str) -> tuple[str, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.stdout, r.stderr


def test_help_and_version_do_not_import_torch():
    out, _ = probe("--help")
    assert "init" in out and "report" in out and "HEAVY [] 0" in out
    out, _ = probe("--version")
    assert f"k3c {k3c.__version__}" in out and "HEAVY [] 0" in out


def test_argument_errors_answer_before_torch(tmp_path):
    """Each in one line on stderr, exit status 2, torch not imported: wrong names and values, unknown options,
    output locations that cannot be written, missing artifacts."""
    (tmp_path / "afile").write_text("")
    for args, message in [(["compile", "no-such-model", "-o", str(tmp_path / "a")], "not a preset"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--target", "tpu9"], "unknown target"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--kda-state", "fp8"],
                           "--kda-state fp8 (kda_state_dtype): expected one of f32, bf16"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--dsa-index-keys", "fp4"],
                           "--dsa-index-keys fp4 (dsa_index_keys): expected one of bf16, fp8, fp8-rerank"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--max-sq", "9"],
                           "No such option: --max-sq"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--plan-only", "--report",
                            str(tmp_path / "afile" / "r.html")], "is not a directory"),
                          (["init", "k3-tiny", "-o", str(tmp_path / "afile" / "ck")], "afile is not a directory"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--max-seq", "-5"],
                           "--max-seq -5: expected at least 1"),
                          (["init", "k3-tiny", "-o", str(tmp_path / "new" / "sub" / "ck")],
                           "sub does not exist (k3c creates no parent directories)"),
                          (["init", "k3-tiny", "-o", str(tmp_path / "ck"), "--seed", "x"],
                           "Invalid value for '--seed'"),
                          (["init", "k3-tiny", "-o", str(tmp_path / "ck"), "--seed", str(2 ** 64)],
                           f"--seed {2 ** 64}: expected 0 .. 2^64 - 1"),
                          (["init", "k3-tiny", "-o", str(tmp_path / "ck"), "--seed", "-1"],
                           "--seed -1: expected 0 .. 2^64 - 1"),
                          (["init", "k3-tiny", "-o", str(tmp_path / "ck"), "--experts-dtype", "fp3"],
                           "--experts-dtype fp3: expected mxfp4 or bf16"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--plan-only", "--force", "--report",
                            str(tmp_path)], f"--report {tmp_path}: is a directory; give a file name"),
                          (["report", str(tmp_path), "-o", str(tmp_path)], f"-o {tmp_path}: is a directory"),
                          (["compile", "k3-tiny", "-o", "", "--force"],
                           "-o is empty or '.': give a path to a new directory"),
                          (["init", "k3-tiny", "-o", ""], "-o is empty or '.': give a path to a new directory"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / "a"), "--plan-only", "--report",
                            str(tmp_path / "a" / "r.html")], "r.html: inside the artifact"),
                          (["inspect", "no-such-model"], "not a preset"),
                          (["inspect", "k3-tiny", "--entry", "both"], "--entry both: expected prefill or decode"),
                          (["run", str(tmp_path / "none")], "no such artifact"),
                          (["finalize", str(tmp_path / "none")], "no such artifact"),
                          (["pack", str(tmp_path / "none")], "no such artifact"),
                          (["report", str(tmp_path), "-o", str(tmp_path / "r.html")], "not a k3c artifact"),
                          (["report", str(tmp_path), "-o", str(tmp_path / ("r" * 251 + ".html"))],
                           "its file name is 256 bytes long"),
                          (["compile", "k3-tiny", "-o", str(tmp_path / ("a" * 256))],
                           "its file name is 256 bytes long")]:
        out, err = probe(*args)
        assert message in err and "HEAVY [] 2" in out and len(err.strip().splitlines()) == 1, (args, out, err)


def test_run_names_a_token_id_outside_the_vocabulary(tmp_path):
    """Negative, at least the vocabulary size, or beyond int64 (2^63): one line naming the id and the range, before
    the artifact is loaded."""
    from cli_inprocess import cli

    from k3c.runtime.artifact import ArtifactWriter

    with ArtifactWriter(tmp_path / "art") as w:   # a manifest is all the check reads: no model is loaded
        for name in ("plan.json", "schedule.json", "report.json"):
            w.add_json(name, {})
        w.commit(config={}, target={}, tp=1, bounds={}, entry_points={}, extra={"vocab_size": 1000})
    for bad, named in [(2**63, str(2**63)), (2**64 + 5, str(2**64 + 5)), (-1, "-1"), (-(2**63) - 1, str(-(2**63) - 1)),
                       (1000, "1000"), (10**100, "1" + "0" * 56 + "...")]:
        rc, err = cli("run", tmp_path / "art", "--tokens", f"1,{bad},2")
        assert (rc, err.splitlines()) == (2, [f"error: --tokens: token id {named} is out of range for the model's "
                                              "vocabulary [0, 1000)"]), bad
    # an id past Python's 4300-digit limit is out of range too, not "not an integer"
    rc, err = cli("run", tmp_path / "art", "--tokens", "9" * 5000)
    assert (rc, err.splitlines()) == (2, [f"error: --tokens: token id {'9' * 57}... is out of range for the model's "
                                          "vocabulary [0, 1000)"])
    # only ASCII decimal integers, comma-separated (spaces around them allowed): no '+', '_', other digits
    for text in ("+1", "1_000", "\u0663", "\uff11", "", "1,,2", "0x10", "1.0", "1 2"):
        rc, err = cli("run", tmp_path / "art", "--tokens", text)
        assert (rc, err.splitlines()) == (2, [f"error: --tokens {text!r}: expected comma-separated integers"]), text
    from k3c.cli.run import _token_ids

    assert _token_ids(" 1, 2 ,3") == [1, 2, 3] and _token_ids("-" + "9" * 200) == [-int("9" * 100)]


def test_init_writes_mxfp4_experts_on_request(tmp_path):
    # the tiny presets' configs have dense experts; --experts-dtype mxfp4 writes them as the published checkpoints
    # do (compressed-tensors MXFP4: u8 packed pairs + u8 E8M0 scales per 32, a quantization_config), and bf16 a
    # dense copy of an MXFP4 config
    import json

    from safetensors import safe_open

    def run(*args):
        r = subprocess.run([sys.executable, "-c", "from k3c.cli import main; main()", "init", *map(str, args)],
                           capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        return r.stdout

    def experts(path):
        out = {}
        for shard in path.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                out.update({k.rsplit(".", 1)[-1]: f.get_slice(k).get_dtype() for k in f.keys()
                            if ".experts.0.w1." in k})
        return out

    assert "MXFP4 experts" in run("k3-tiny", "-o", tmp_path / "mx", "--experts-dtype", "mxfp4")
    assert experts(tmp_path / "mx") == {"weight_packed": "U8", "weight_scale": "U8"}
    text = json.loads((tmp_path / "mx" / "config.json").read_text())["text_config"]
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert "f32 experts" in run(tmp_path / "mx" / "config.json", "-o", tmp_path / "dense", "--experts-dtype", "bf16")
    assert experts(tmp_path / "dense") == {"weight": "F32"}
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())["text_config"]


def test_init_refuses_a_full_size_checkpoint(tmp_path):
    out, err = probe("init", "kimi-linear-48b", "-o", str(tmp_path / "c"))
    assert "GiB (init writes at most 4 GiB)" in err and out.rstrip().endswith(" 2") and not (tmp_path / "c").exists()


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("library", ["converts", "swallows"])
def test_sigterm_exits_143_whatever_a_library_makes_of_it(monkeypatch, library, signum):
    """TVM turns the handler's SystemExit(143), raised inside a Python callback it called, into RuntimeError('143');
    another library may catch it and go on. Either way the command exits 128 + signum (seen first in CI: a compile
    exited 0). SIGHUP (a closed terminal) is handled as SIGTERM is."""
    import signal

    import k3c.cli as cli
    from k3c import termination

    monkeypatch.setattr(termination, "_requested", None)
    sig = getattr(signal, signum)

    def command(standalone_mode):
        try:
            signal.raise_signal(sig)
        except SystemExit as e:
            if library == "converts":
                raise RuntimeError(str(e.code)) from None
        return 0

    monkeypatch.setattr(cli, "app", command)
    outer = signal.signal(sig, signal.SIG_DFL)   # as a shell starts a command (make under nohup ignores SIGHUP)
    try:
        with pytest.raises(SystemExit) as exc:
            cli.main()
        assert exc.value.code == 128 + sig
        assert signal.getsignal(sig) is signal.SIG_DFL          # the caller's handler is back
        signal.signal(sig, signal.SIG_IGN)                      # under nohup (SIGHUP) the signal stays ignored
        monkeypatch.setattr(termination, "_requested", None)
        cli.main()
        assert termination.requested() is None and signal.getsignal(sig) is signal.SIG_IGN
    finally:
        signal.signal(sig, outer)


def test_a_swallowed_ctrl_c_exits_130_and_commits_nothing(monkeypatch, tmp_path):
    """Ctrl-C raised where a library swallows it (a weakref callback did, under `k3c report`: the report was
    replaced and the command exited 0) is recorded: the commit that follows is refused, the old file stays, and
    the command exits 130. Where Ctrl-C is ignored (a background job without job control) it stays ignored."""
    import signal

    import k3c.cli as cli
    from k3c import termination
    from k3c.atomic import replacing

    monkeypatch.setattr(termination, "_requested", None)
    target = tmp_path / "r.html"
    target.write_text("old")

    def command(standalone_mode):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass                                    # swallowed
        with replacing(target) as tmp:
            tmp.write_text("new")
        return 0

    monkeypatch.setattr(cli, "app", command)
    # Python's own handler, as in a terminal (a process started with SIGINT ignored, e.g. a background job
    # without job control, inherits SIG_IGN instead)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exc:
            cli.main()
        assert exc.value.code == 130 and target.read_text() == "old"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # the caller's handler is back
        monkeypatch.setattr(termination, "_requested", None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cli.main()                                  # ignored: the command runs and commits
        assert termination.requested() is None and target.read_text() == "new"
    finally:
        signal.signal(signal.SIGINT, outer)


def test_sigterm_removes_the_unfinished_artifact(tmp_path):
    """A compile ended by SIGTERM (as `timeout` or a scheduler ends it) leaves neither the artifact nor its staging
    directory: the signal is sent once the staging directory exists, i.e. mid-compile."""
    import signal
    import time

    import torch

    from models.config import K3Config
    from models.k3 import save_random_checkpoint

    save_random_checkpoint(K3Config.from_pretrained("k3-tiny"), tmp_path / "ckpt", dtype=torch.float32)
    proc = subprocess.Popen([sys.executable, "-c", "from k3c.cli import main; main()", "compile", str(tmp_path / "ckpt"),
                             "-o", str(tmp_path / "o"), "--target", "cpu-x86-64"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".o.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()  # still compiling when the staging directory appeared
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs the graphviz `dot` binary")
def test_inspect_svg_goes_to_its_svg_name_and_keeps_an_existing_one(tmp_path):
    """graphviz draws into NAME.svg whatever suffix -o has: that file is the one checked for --force, and the
    drawing is written whole (no temporary or DOT source left beside it)."""
    cmd = [sys.executable, "-m", "k3c.cli", "inspect", "k3-tiny", "--format", "svg", "--collapse", "-o", "g.png"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.svg"]
    assert (tmp_path / "g.svg").read_text().startswith("<?xml") and "</svg>" in (tmp_path / "g.svg").read_text()
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and "-o g.svg: already exists" in run.stderr


def test_mixed_checkpoint_names_the_tensors_an_artifact_rounds(tmp_path):
    # a bf16 checkpoint (by its embedding table) with lm_head stored as f32 values bf16 cannot hold: compiling it
    # in bf16 rounds that tensor, and `_rounded_tensors` names it; the f32 parameters the model keeps in f32
    # (A_log, dt_bias, convs, o_norm: stored f32 in every bf16 checkpoint) are not named
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from k3c.cli.build import _rounded_tensors
    from models.checkpoint import save_random_checkpoint

    path = tmp_path / "ck"
    save_random_checkpoint("k3-tiny", path, dtype=torch.bfloat16)
    assert _rounded_tensors(path, "bf16") == []
    key = next(k for s in path.glob("*.safetensors") for k in safe_open(str(s), "pt").keys()
               if k.endswith("lm_head.weight"))
    shard = next(s for s in path.glob("*.safetensors") if key in safe_open(str(s), "pt").keys())
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = tensors[key].float() * (1 + 2 ** -12)        # off bf16's grid
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert _rounded_tensors(path, "bf16") == [key]
    assert _rounded_tensors(path, "f32") == []


def test_init_on_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    # safetensors reports a failed write (ENOSPC) as its own exception type, not OSError: init must still answer
    # with one line naming the shard, and remove its temporary directory
    import safetensors

    import models.checkpoint as checkpoint
    from k3c.errors import CheckpointError

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint file model-00001-of-\d+\.safetensors of .*c: "
                                              r".*No space left on device"):
        checkpoint.save_random_checkpoint("k3-tiny", tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_a_report_that_cannot_be_written_says_the_artifact_is(tmp_path, monkeypatch):
    # `compile --report` writes the page after the artifact is in place: a failure there must not read as if the
    # compile had failed
    import k3c.report.html as html
    from cli_inprocess import cli
    from k3c.errors import K3CError

    def full(art, out):
        raise K3CError(f"cannot write {out}: No space left on device")

    monkeypatch.setattr(html, "write", full)
    rc, err = cli("compile", "k3-tiny", "-o", tmp_path / "a", "--plan-only", "--report", tmp_path / "r.html")
    assert rc == 2 and (tmp_path / "a" / "manifest.json").is_file(), err
    assert f"No space left on device (the artifact {tmp_path / 'a'} is written; `k3c report" in " ".join(err.split())
