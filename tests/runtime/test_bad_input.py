"""Bad input to compile / load / run: each gets one clear line naming the problem and a non-zero exit, and
nothing is left half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from k3c.errors import ArtifactError, RuntimeInputError  # noqa: E402
from models.config import K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402


def k3c_cli(*args):
    r = subprocess.run([sys.executable, "-m", "k3c.cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == (1 if r.returncode else 0), r.stderr  # exactly one error line, no traceback
    assert "Traceback" not in r.stderr
    return r.returncode, errors[0] if errors else ""


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    save_random_checkpoint(K3Config.from_pretrained("kimi-linear-tiny"), root / "ckpt", seed=0, dtype=torch.float32)
    opts = CompileOptions(str(root / "ckpt"), root / "art", target="cpu-x86-64", max_batch=2, max_seq=16,
                          max_prefill=8, dtype="f32")
    compile_model(opts)
    return root


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_config_with_missing_and_wrong_typed_field(tmp_path):
    raw = K3Config.from_pretrained("k3-tiny").raw
    bad = json.loads(json.dumps(raw))
    del bad["text_config"]["hidden_size"]
    (tmp_path / "a.json").write_text(json.dumps(bad))
    rc, err = k3c_cli("compile", tmp_path / "a.json", "-o", tmp_path / "out", "--plan-only")
    assert rc == 2 and "hidden_size" in err
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["num_hidden_layers"] = "ten"
    (tmp_path / "b.json").write_text(json.dumps(bad))
    rc, err = k3c_cli("compile", tmp_path / "b.json", "-o", tmp_path / "out", "--plan-only")
    assert rc == 2 and "num_hidden_layers" in err and not (tmp_path / "out").exists()


def test_checkpoint_with_nan_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_random_checkpoint(K3Config.from_pretrained("kimi-linear-tiny"), tmp_path / "c", seed=0)
    shard = sorted((tmp_path / "c").glob("*.safetensors"))[0]
    t = load_file(str(shard))
    key = sorted(t)[0]
    t[key] = t[key].clone().float().fill_(float("nan")).to(t[key].dtype)
    save_file(t, str(shard), metadata={"format": "pt"})
    rc, err = k3c_cli("compile", tmp_path / "c", "-o", tmp_path / "out", "--dtype", "f32")
    assert rc == 2 and key in err and "NaN" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("victim", ["kernel", "weights"])
def test_changed_byte_in_artifact_is_detected(art, tmp_path, victim):
    a = _copy(art / "art", tmp_path / "a")
    kernel = (sorted((a / "kernels").glob("*.py")) or [a / "kernels" / "cpu.so"])[0]  # Triton module or TVM library
    f = kernel if victim == "kernel" else a / "weights" / "params.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f.name):
        k3c.load(a, "cpu")
    rc, err = k3c_cli("run", a, "--tokens", "1,2")
    assert rc == 2 and f.name in err


def test_newer_format_version_is_refused(art, tmp_path):
    a = _copy(art / "art", tmp_path / "a")
    m = json.loads((a / "manifest.json").read_text())
    m["format_version"] += 1
    (a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="version"):
        k3c.load(a, "cpu")


def test_tokens_and_bounds_are_checked(art):
    s = k3c.load(art / "art", "cpu")
    with pytest.raises(RuntimeInputError, match="vocabulary"):
        s.prefill(torch.tensor([[1, 10**6]]))
    with pytest.raises(RuntimeInputError, match="max_seq"):
        s.prefill(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(RuntimeInputError, match="max_batch"):
        s.prefill(torch.zeros(3, 2, dtype=torch.long))
    s.prefill(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(RuntimeInputError, match="batch"):
        s.decode(torch.zeros(2, 1, dtype=torch.long))
    rc, err = k3c_cli("run", art / "art", "--tokens", "1,999999")
    assert rc == 2 and "vocabulary" in err


def test_existing_output_directory_is_refused_unless_force(art, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = k3c_cli("compile", art / "ckpt", "-o", out, "--dtype", "f32", "--max-seq", "16", "--max-prefill", "8")
    assert rc == 2 and "exists" in err and (out / "keep.txt").read_text() == "mine"


def test_truncated_shard_is_a_checkpoint_error(art, tmp_path):
    ckpt = _copy(art / "ckpt", tmp_path / "c")
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    rc, err = k3c_cli("compile", ckpt, "-o", tmp_path / "out", "--dtype", "f32")
    assert rc == 2 and shard.name in err and "safetensors" in err and not (tmp_path / "out").exists()


def test_bad_device_and_run_lengths_are_checked_up_front(art):
    rc, err = k3c_cli("run", art / "art", "--tokens", "1,2", "--device", "tpu")
    assert rc == 2 and "tpu" in err
    if not torch.cuda.is_available():
        rc, err = k3c_cli("run", art / "art", "--tokens", "1,2", "--device", "cuda")
        assert rc == 2 and "CUDA" in err
    rc, err = k3c_cli("run", art / "art", "--tokens", ",".join(["1"] * 10), "--decode-steps", "8")  # max_seq 16
    assert rc == 2 and "max_seq 16" in err
    rc, err = k3c_cli("run", art / "art", "--tokens", "1", "--decode-steps", "0")
    assert rc == 2 and "--decode-steps" in err


def test_inspect_output_paths(tmp_path):
    rc, err = k3c_cli("inspect", "kimi-linear-tiny", "-o", tmp_path)
    assert rc == 2 and "directory" in err
    rc, _ = k3c_cli("inspect", "kimi-linear-tiny", "--format", "summary", "-o", tmp_path / "s.txt")
    assert rc == 0 and "moe_experts" in (tmp_path / "s.txt").read_text()


def test_max_seq_beyond_the_model_context_is_refused(tmp_path):
    rc, err = k3c_cli("compile", "k3-tiny", "-o", tmp_path / "o", "--plan-only", "--max-seq", "99999999999")
    assert rc == 2 and "max_position_embeddings" in err and not (tmp_path / "o").exists()


def test_output_locations_that_cannot_be_written_fail_before_compiling(art, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    rc, err = k3c_cli("compile", "k3-tiny", "-o", afile / "sub", "--plan-only")
    assert rc == 2 and "afile" in err and afile.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no staging directory left behind
    rc, err = k3c_cli("compile", "k3-tiny", "-o", tmp_path / "o", "--plan-only", "--dump", afile)
    assert rc == 2 and "afile" in err and not (tmp_path / "o").exists()
    rc, err = k3c_cli("inspect", "k3-tiny", "-o", tmp_path / "nodir" / "x.txt")
    assert rc == 2 and "nodir" in err


def test_inspect_does_not_overwrite_without_force(tmp_path):
    out = tmp_path / "ir.txt"
    out.write_text("mine")
    rc, err = k3c_cli("inspect", "k3-tiny", "-o", out)
    assert rc == 2 and "--force" in err and out.read_text() == "mine"
    rc, _ = k3c_cli("inspect", "k3-tiny", "-o", out, "--force", "--after", "form_kernels")
    assert rc == 0 and "| kernel prefill_k0001_" in out.read_text()


def test_bf16_artifact_is_refused_on_cpu(art, tmp_path):
    """Triton's interpreter computes bf16 tl.dot wrongly: a CPU run must refuse rather than print wrong tokens."""
    compile_model(CompileOptions(str(art / "ckpt"), tmp_path / "b", target="cpu-x86-64", max_batch=1, max_seq=16,
                                 max_prefill=8, dtype="bf16", backend="triton"))
    with pytest.raises(RuntimeInputError, match="bf16 artifact with Triton kernels cannot run on CPU.*--dtype f32"):
        k3c.load(tmp_path / "b", "cpu")


def test_malformed_run_and_check_arguments(art):
    for tokens in ("1,,2", "99999999999999999999999", "-3"):
        rc, err = k3c_cli("run", art / "art", "--tokens", tokens)
        assert rc == 2 and "--tokens" in err, tokens
    rc, err = k3c_cli("check", "k3-tiny", "--batch", "0")
    assert rc == 2 and "--batch" in err


def test_integer_weights_are_refused(art, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = _copy(art / "ckpt", tmp_path / "c")
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    t = load_file(str(shard))
    key = next(k for k, v in t.items() if v.is_floating_point())
    t[key] = t[key].to(torch.int32)
    save_file(t, str(shard), metadata={"format": "pt"})
    rc, err = k3c_cli("compile", ckpt, "-o", tmp_path / "out", "--dtype", "f32")
    assert rc == 2 and key in err and "int32" in err and not (tmp_path / "out").exists()


def test_edited_manifest_vocab_is_refused(art, tmp_path):
    a = _copy(art / "art", tmp_path / "a")
    m = json.loads((a / "manifest.json").read_text())
    m["extra"]["vocab_size"] += 7
    (a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="vocab_size"):
        k3c.load(a, "cpu")
