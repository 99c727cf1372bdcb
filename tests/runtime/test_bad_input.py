"""Bad input to compile / load / run: each gets one clear line naming the problem and a non-zero exit, and
nothing is left half-written. The CLI runs in this process (`cli`), as `main()` would from a shell."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import k3c  # noqa: E402
from k3c.compile import CompileOptions, compile_model  # noqa: E402
from k3c.errors import ArtifactError, RuntimeInputError  # noqa: E402
from models.config import K3Config  # noqa: E402
from models.k3 import save_random_checkpoint  # noqa: E402

from cli_inprocess import cli  # noqa: E402
from runtime_sizes import MAX_BATCH, MAX_PREFILL, MAX_SEQ  # noqa: E402

pytestmark = pytest.mark.slow  # compiles artifacts and runs them: `make test`, not `make test-quick`


def k3c_cli(*args) -> tuple[int, str]:
    """(exit status, the one `error:` line); asserts a failure prints exactly one error line and no traceback."""
    rc, stderr = cli(*args)
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == (1 if rc else 0), stderr
    assert "Traceback" not in stderr
    return rc, errors[0] if errors else ""


@pytest.fixture(scope="module")
def art(compiled):
    """The directory holding `ckpt/` and `art/`: kimi-linear-tiny f32, shared with the end-to-end tests
    (MAX_BATCH sequences of MAX_SEQ tokens, MAX_PREFILL per prefill call)."""
    ckpt, _, _ = compiled("kimi-linear-tiny")
    return ckpt.parent


@pytest.fixture(scope="module")
def bf16_art(art, tmp_path_factory):
    """The same checkpoint and bounds compiled bf16 with Triton kernels for the CPU target (refused on CPU)."""
    out = tmp_path_factory.mktemp("bf16") / "b"
    compile_model(CompileOptions(str(art / "ckpt"), out, target="cpu-x86-64", max_batch=MAX_BATCH, max_seq=MAX_SEQ,
                                 max_prefill=MAX_PREFILL, dtype="bf16", backend="triton"))
    return out


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


def test_checkpoint_with_a_nan_mxfp4_scale_is_refused(tmp_path):
    # E8M0 byte 255 encodes NaN: the compile names the scale tensor and writes nothing
    from safetensors.torch import load_file, save_file

    save_random_checkpoint(K3Config.from_pretrained("k3-tiny"), tmp_path / "c", seed=0, expert_format="mxfp4")
    for shard in sorted((tmp_path / "c").glob("*.safetensors")):
        t = load_file(str(shard))
        keys = sorted(k for k in t if k.endswith(".weight_scale"))
        if keys:
            t[keys[0]] = t[keys[0]].clone().fill_(255)
            save_file(t, str(shard), metadata={"format": "pt"})
            break
    rc, err = k3c_cli("compile", tmp_path / "c", "-o", tmp_path / "out", "--target", "cpu-x86-64")
    assert rc == 2 and keys[0] in err and "NaN" in err and not (tmp_path / "out").exists()


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
    with pytest.raises(RuntimeInputError, match=f"max_seq {MAX_SEQ}"):
        s.prefill(torch.zeros(1, MAX_SEQ + 1, dtype=torch.long))
    with pytest.raises(RuntimeInputError, match=f"max_batch {MAX_BATCH}"):
        s.prefill(torch.zeros(MAX_BATCH + 1, 2, dtype=torch.long))
    s.prefill(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(RuntimeInputError, match="batch"):
        s.decode(torch.zeros(2, 1, dtype=torch.long))
    rc, err = k3c_cli("run", art / "art", "--tokens", "1,999999")
    assert rc == 2 and "vocabulary" in err
    with pytest.raises(RuntimeInputError, match=r"int64 or int32 .* got a torch.int16 tensor of shape \[1, 2\]"):
        s.decode(torch.zeros(1, 2, dtype=torch.int16))
    with pytest.raises(RuntimeInputError, match="steps=True"):
        s.generate(torch.zeros(1, 1, dtype=torch.long), True)


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
    for dtype in ("f32", "auto"):  # auto: the dtype is read from the embedding's shard header first
        rc, err = k3c_cli("compile", ckpt, "-o", tmp_path / "out", "--dtype", dtype)
        assert rc == 2 and shard.name in err and "safetensors" in err and not (tmp_path / "out").exists()
    index = ckpt / "model.safetensors.index.json"
    for text in ("garbage", '{"weight_map": 5}'):
        index.write_text(text)
        for dtype in ("f32", "auto"):
            rc, err = k3c_cli("compile", ckpt, "-o", tmp_path / "out", "--dtype", dtype)
            assert rc == 2 and index.name in err and "weight_map" in err and not (tmp_path / "out").exists()


def test_bad_device_and_run_lengths_are_checked_up_front(art):
    rc, err = k3c_cli("run", art / "art", "--tokens", "1,2", "--device", "tpu")
    assert rc == 2 and "tpu" in err
    if not torch.cuda.is_available():
        rc, err = k3c_cli("run", art / "art", "--tokens", "1,2", "--device", "cuda")
        assert rc == 2 and "CUDA" in err
    rc, err = k3c_cli("run", art / "art", "--tokens", ",".join(["1"] * (MAX_SEQ - 7)), "--decode-steps", "9")
    assert rc == 2 and f"max_seq {MAX_SEQ}" in err
    rc, err = k3c_cli("run", art / "art", "--tokens", "1", "--decode-steps", "0")
    assert rc == 2 and "--decode-steps" in err


def test_inspect_output_paths(tmp_path):
    rc, err = k3c_cli("inspect", "kimi-linear-tiny", "-o", tmp_path)
    assert rc == 2 and "directory" in err
    rc, _ = k3c_cli("inspect", "kimi-linear-tiny", "--format", "summary", "-o", tmp_path / "s.txt")
    assert rc == 0 and "moe_experts" in (tmp_path / "s.txt").read_text()


def test_max_seq_beyond_the_model_context_is_refused(tmp_path):
    rc, err = k3c_cli("compile", "k3-tiny", "-o", tmp_path / "o", "--plan-only", "--max-seq", "2000000000")
    assert rc == 2 and "max_position_embeddings" in err and not (tmp_path / "o").exists()
    rc, err = k3c_cli("compile", "k3-tiny", "-o", tmp_path / "o", "--plan-only", "--max-batch", "9" * 23)
    assert rc == 2 and f"--max-batch {'9' * 23}: must be below 2^31" in err and not (tmp_path / "o").exists()


def test_output_locations_that_cannot_be_written_fail_before_compiling(art, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    rc, err = k3c_cli("compile", "k3-tiny", "-o", afile / "sub", "--plan-only")
    assert rc == 2 and "afile" in err and afile.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no staging directory left behind
    rc, err = k3c_cli("compile", "k3-tiny", "-o", tmp_path / "o", "--plan-only", "--dump", afile)
    assert rc == 2 and "afile" in err and not (tmp_path / "o").exists()
    kept = tmp_path / "kept" / "prefill"  # a --dump directory holding a user's file: refused, the file kept
    kept.mkdir(parents=True)
    (kept / "00-input.txt").write_text("mine")
    rc, err = k3c_cli("compile", "k3-tiny", "-o", tmp_path / "o", "--plan-only", "--dump", tmp_path / "kept")
    assert rc == 2 and "not an empty directory" in err and (kept / "00-input.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists()
    rc, err = k3c_cli("inspect", "k3-tiny", "-o", tmp_path / "nodir" / "x.txt")
    assert rc == 2 and "nodir" in err


def test_inspect_does_not_overwrite_without_force(tmp_path):
    out = tmp_path / "ir.txt"
    out.write_text("mine")
    rc, err = k3c_cli("inspect", "k3-tiny", "-o", out)
    assert rc == 2 and "--force" in err and out.read_text() == "mine"
    rc, _ = k3c_cli("inspect", "k3-tiny", "-o", out, "--force", "--after", "form_kernels")
    assert rc == 0 and "| kernel prefill_k0001_" in out.read_text()


def test_bf16_artifact_is_refused_on_cpu(bf16_art):
    """Triton's interpreter computes bf16 tl.dot wrongly: a CPU run must refuse rather than print wrong tokens."""
    with pytest.raises(RuntimeInputError, match="bf16 artifact with Triton kernels cannot run on CPU.*--dtype f32"):
        k3c.load(bf16_art, "cpu")


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


# ---- issue 15: the manifest is covered by the integrity check, weights are checked, memory is checked --------------
def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("field, value", [("bounds.max_seq", 100000), ("extra.dtype", "bf16"),
                                          ("bounds.max_batch", 1000)])
def test_edited_manifest_field_is_named(art, tmp_path, field, value):
    """Raising max_seq or max_batch, or relabelling the dtype, in manifest.json once gave wrong logits or a raw
    RuntimeError: the manifest is checked against the hashed build.json, naming the file and the field."""
    a = _copy(art / "art", tmp_path / "a")
    section, key = field.split(".")
    _edit_json(a / "manifest.json", lambda m: m[section].__setitem__(key, value))
    with pytest.raises(ArtifactError, match=f"manifest.json field {field} is {value!r} but the hashed build.json"):
        k3c.load(a, "cpu")
    rc, err = k3c_cli("run", a, "--tokens", "1,2")
    assert rc == 2 and f"manifest.json field {field}" in err


@pytest.mark.parametrize("mix", ["as_is", "shared_names"])
def test_weights_of_another_build_are_named(art, bf16_art, tmp_path, mix):
    """Another build's weights with the manifest's hash updated are checked against schedule.json, tensor by tensor:
    the bf16 build's file as it is (its weights are grouped otherwise: fuse_gemms fuses linears reading one input,
    and in bf16 the router reads an fp32 copy of the hidden state, so only the f32 build fuses the router with the
    shared expert: that key is missing), and the f32 build's file with every tensor both builds share taken from the
    bf16 one (same names, other dtype)."""
    import hashlib

    from safetensors.torch import load_file, save_file

    a = _copy(art / "art", tmp_path / "a")
    path = a / "weights" / "params.safetensors"
    own, other = load_file(path), load_file(bf16_art / "weights" / "params.safetensors")
    save_file(other if mix == "as_is" else {k: other.get(k, v) for k, v in own.items()}, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _edit_json(a / "manifest.json", lambda m: m["files"].__setitem__("weights/params.safetensors", digest))
    want = (r"params.safetensors: lacks tensor '.+' that schedule.json reads" if mix == "as_is" else
            r"params.safetensors: tensor '.+' is bfloat16 \[.*\], schedule.json expects float32")
    with pytest.raises(ArtifactError, match=want):
        k3c.load(a, "cpu")
    rc, err = k3c_cli("run", a, "--tokens", "1,2")
    assert rc == 2 and re.search(want, err), err


def test_plan_beyond_every_gpu_count_is_refused_unless_allowed(tmp_path):
    """`--max-batch 1000000000` once wrote petabytes of KV cache for an H200 without a word."""
    args = ("compile", "k3-tiny", "--plan-only", "--max-batch", "1000000000", "--max-seq", "4096")
    rc, err = k3c_cli(*args, "-o", tmp_path / "o")
    assert rc == 2 and "per rank on h200" in err and "pools.kv" in err and "--allow-oversize" in err
    assert not (tmp_path / "o").exists()
    rc, stderr = cli(*args, "-o", tmp_path / "p", "--allow-oversize")
    assert rc == 0 and "warning:" in stderr and "written anyway" in stderr
    budget = json.loads((tmp_path / "p" / "plan.json").read_text())["budget"]
    kv = json.loads((tmp_path / "p" / "plan.json").read_text())["pool_totals"]["kv"]
    assert budget["fits"] is False and budget["min_gpus"] is None and budget["items"]["pools.kv"] == kv
    assert kv == 3 * 10**9 * 4096 * (32 + 8) * 2  # 3 MLA layers x B x max_seq x (kv_lora_rank + rope dim) bf16


def test_artifact_beyond_free_memory_is_refused_at_load(art, tmp_path):
    """A tiny artifact at --max-batch 100000 --max-seq 1048576 (written with --allow-oversize) once ended `run`
    with a 54-line traceback: its pools are checked against the free memory before anything is allocated."""
    rc, _ = k3c_cli("compile", art / "ckpt", "-o", tmp_path / "big", "--target", "cpu-x86-64", "--dtype", "f32",
                    "--max-batch", "100000", "--max-seq", "1048576", "--max-prefill", "16", "--allow-oversize")
    assert rc == 0
    rc, err = k3c_cli("run", tmp_path / "big", "--tokens", "1,2")
    assert rc == 2 and "the artifact needs" in err and "is free (pools.kv" in err and "max_batch 100000" in err


def test_plan_bounds_edited_with_its_hash_are_cross_checked(art, tmp_path):
    """plan.json edited and its hash updated in the manifest: the bounds the runtime takes from it must still agree
    with the pools and arena it records (here max_batch raised in both entries)."""
    import hashlib

    a = _copy(art / "art", tmp_path / "a")
    _edit_json(a / "plan.json", lambda p: [b.__setitem__("B", 1000) for b in p["bounds"].values()])
    digest = hashlib.sha256((a / "plan.json").read_bytes()).hexdigest()
    _edit_json(a / "manifest.json", lambda m: m["files"].__setitem__("plan.json", digest))
    with pytest.raises(ArtifactError, match=r"plan.json: pools\.\S+ is .* but schedule.json gives .* at the bounds"):
        k3c.load(a, "cpu")
