"""Artifact I/O: round trip, determinism, corruption, versions, atomic replace, packing."""

import hashlib
import json
import os
import stat
import tarfile

import pytest
import safetensors.torch
import torch

from k3c.errors import ArtifactError
from k3c.runtime import artifact as A
from k3c.runtime.artifact import ArtifactWriter, canonical_json, pack, read_artifact

MANIFEST_FIELDS = dict(config={"model_type": "kimi_k3", "hidden_size": 64}, target={"name": "h200", "kind": "cuda"},
                       tp=1, bounds={"max_batch": 2, "max_seq": 128}, entry_points={"prefill": {}, "decode": {}})


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"w.b": torch.randn(3, 5, generator=g).to(torch.bfloat16), "w.a": torch.randn(7, generator=g),
            "mask": torch.tensor([True, False]), "idx": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "fp8": torch.ones(4).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 3)}


def _write(out, force=False, weights=True, plan=None):
    with ArtifactWriter(out, force=force) as w:
        w.add_json("plan.json", plan or {"arena_bytes": 4096, "buffers": {"x": {"offset": 0}}})
        w.add_json("schedule.json", {"launches": [{"kernel": "k0", "grid": [1, 1, 1]}]})
        w.add_json("report.json", {"flops": 1.5e9})
        w.add_text("kernels/k0.py", "# kernel k0\n")
        w.add_bytes("kernels/k0.cubin", bytes(range(256)))
        w.add_text("graph/final.txt", "%0 = input : bf16[B,T,64]\n")
        if weights:
            w.add_tensors("weights/rank0.safetensors", _tensors(), {"rank": "0"})
        return w.commit(**MANIFEST_FIELDS)


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_round_trip(tmp_path):
    out = _write(tmp_path / "art")
    art = read_artifact(out)
    assert art.format_version == A.FORMAT_VERSION and art.manifest["tp"] == 1 and art.has_weights
    assert art.manifest["bounds"] == {"max_batch": 2, "max_seq": 128}
    assert art.plan["arena_bytes"] == 4096 and art.schedule["launches"][0]["kernel"] == "k0"
    assert art.read_text("kernels/k0.py") == "# kernel k0\n" and art.read_bytes("kernels/k0.cubin") == bytes(range(256))
    # independent hash of the file on disk
    assert art.files["kernels/k0.cubin"] == hashlib.sha256(bytes(range(256))).hexdigest()
    loaded = art.load_tensors("weights/rank0.safetensors")
    for name, t in _tensors().items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name].float(), t.float())
    # the file is standard safetensors: the library reads it and its metadata
    with safetensors.safe_open(out / "weights/rank0.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "rank": "0"} and sorted(f.keys()) == sorted(_tensors())
    assert set(_tree(out)) == {"manifest.json", "build.json", "plan.json", "schedule.json", "report.json", "kernels/k0.py",
                               "kernels/k0.cubin", "graph/final.txt", "weights/rank0.safetensors"}


def test_plan_only_artifact_has_no_weights(tmp_path):
    art = read_artifact(_write(tmp_path / "art", weights=False))
    assert not art.has_weights and not (tmp_path / "art" / "weights").exists()


def test_double_write_is_byte_identical(tmp_path):
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    assert _tree(a) == _tree(b)
    assert pack(a).read_bytes() == pack(b).read_bytes()


def test_canonical_json_format():
    assert canonical_json({"b": 1, "a": [1, 2]}) == b'{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    with pytest.raises(ArtifactError, match="x.json"):
        canonical_json({"v": float("nan")}, "x.json")


@pytest.mark.parametrize("rel", ["kernels/k0.cubin", "weights/rank0.safetensors", "plan.json"])
def test_corrupted_byte_is_named(tmp_path, rel):
    out = _write(tmp_path / "art")
    path = out / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{rel} is corrupted"):
        read_artifact(out)
    art = read_artifact(out, verify=False)  # lazy mode: caught when the file is read
    with pytest.raises(ArtifactError, match=f"{rel} is corrupted"):
        art.read_bytes(rel)


def test_missing_and_unlisted_files(tmp_path):
    out = _write(tmp_path / "art")
    (out / "kernels/k0.py").unlink()
    with pytest.raises(ArtifactError, match="missing file.*kernels/k0.py"):
        read_artifact(out)
    out2 = _write(tmp_path / "art2")
    (out2 / "kernels/extra.py").write_text("x")
    with pytest.raises(ArtifactError, match="not listed.*kernels/extra.py"):
        read_artifact(out2)


def test_newer_format_version_is_refused(tmp_path):
    out = _write(tmp_path / "art")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format_version"] = A.FORMAT_VERSION + 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"format version {A.FORMAT_VERSION + 1}.*reads \\(format version "
                                            f"{A.FORMAT_VERSION}"):
        read_artifact(out)


def test_older_format_version_is_refused(tmp_path):
    out = _write(tmp_path / "art")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format_version"] = A.FORMAT_VERSION - 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"format version {A.FORMAT_VERSION - 1} predates.*recompile it"):
        read_artifact(out)


@pytest.mark.parametrize("edit, field", [(lambda m: m["config"].__setitem__("hidden_size", 65), "config.hidden_size"),
                                         (lambda m: m["bounds"].pop("max_seq"), "bounds.max_seq"),
                                         (lambda m: m.__setitem__("tp", 1.0), "tp"),
                                         (lambda m: m.__setitem__("extra", {"dtype": "f32"}), "extra")])
def test_edited_manifest_field_is_named(tmp_path, edit, field):
    """Every manifest field but `files` is checked against the hashed build.json (types too: 1.0 is not 1)."""
    out = _write(tmp_path / "art")
    manifest = json.loads((out / "manifest.json").read_text())
    assert json.loads((out / "build.json").read_text()) == {k: v for k, v in manifest.items() if k != "files"}
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"manifest.json field {field} is .* but the hashed build.json records"):
        read_artifact(out)


def test_existing_out_dir_refused_and_force_replaces(tmp_path):
    out = _write(tmp_path / "art", plan={"arena_bytes": 1})
    with pytest.raises(ArtifactError, match="already exists"):
        ArtifactWriter(out)
    os.chmod(out, 0o750)                                          # the replaced artifact's permissions stay
    _write(out, force=True, plan={"arena_bytes": 2})
    assert read_artifact(out).plan == {"arena_bytes": 2} and stat.S_IMODE(out.stat().st_mode) == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temp or old directories left
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not a k3c artifact"):
        ArtifactWriter(tmp_path / "notes", force=True)
    # a link, to an artifact or to nothing, is never replaced (that would put a directory where the link was)
    (tmp_path / "link").symlink_to("art")
    (tmp_path / "dangling").symlink_to("gone")
    for link in ("link", "dangling"):
        for force in (False, True):
            with pytest.raises(ArtifactError, match=f"{link}: it is a symbolic link; give the directory's own path"):
                ArtifactWriter(tmp_path / link, force=force)
    assert read_artifact(out).plan == {"arena_bytes": 2}


def test_exception_while_adding_leaves_nothing(tmp_path):
    out = _write(tmp_path / "art", plan={"arena_bytes": 1})
    before = _tree(out)
    with pytest.raises(RuntimeError, match="boom"):
        with ArtifactWriter(out, force=True) as w:
            w.add_json("plan.json", {"arena_bytes": 2})
            raise RuntimeError("boom")
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_failure_mid_commit_keeps_old_dir(tmp_path, monkeypatch):
    out = _write(tmp_path / "art", plan={"arena_bytes": 1})
    before = _tree(out)
    real_rename = os.rename

    def flaky_rename(src, dst):  # moving the old artifact away works; moving the new one in fails
        if ".tmp-" in str(src):
            raise OSError("disk on fire")
        return real_rename(src, dst)

    monkeypatch.setattr(A.os, "rename", flaky_rename)
    with pytest.raises(ArtifactError) as exc:   # named by the artifact asked for, not by its staging directory
        _write(out, force=True, plan={"arena_bytes": 2})
    assert str(exc.value) == f"cannot write the artifact {out}: disk on fire"
    monkeypatch.undo()
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    with pytest.raises(ArtifactError, match="lacks required file.*report.json"):  # commit checks, then cleans up
        with ArtifactWriter(tmp_path / "new") as w:
            w.add_json("plan.json", {})
            w.add_json("schedule.json", {})
            w.commit(**MANIFEST_FIELDS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_long_artifact_name_is_written_or_refused_up_front(tmp_path):
    """A directory name at the file system's limit is written and replaced (staging and set-aside names are short);
    one beyond it is refused before anything is written, naming it."""
    from k3c.atomic import name_max

    limit = name_max(tmp_path)
    out = _write(tmp_path / ("a" * limit), plan={"arena_bytes": 1})
    _write(out, force=True, plan={"arena_bytes": 2})
    assert read_artifact(out).plan == {"arena_bytes": 2} and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    too_long = tmp_path / ("b" * (limit + 1))
    with pytest.raises(ArtifactError, match=f"cannot create the artifact {too_long}: its file name is {limit + 1} "):
        ArtifactWriter(too_long)


def test_termination_swallowed_by_a_library_stops_the_commit(tmp_path, monkeypatch):
    """A SIGTERM whose SystemExit a library caught (or turned into another error) is still recorded: the commit
    refuses to start, leaves the old artifact as it was and no staging directory, and exits 128 + 15."""
    from k3c import termination

    out = _write(tmp_path / "art", plan={"arena_bytes": 1})
    before = _tree(out)
    monkeypatch.setattr(termination, "_requested", None)
    try:
        termination.request(15)
    except SystemExit as e:  # what a library's `except BaseException: pass` does
        assert e.code == 143
    with pytest.raises(SystemExit) as exc:
        _write(out, force=True, plan={"arena_bytes": 2})
    assert exc.value.code == 143
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_during_the_swap_acts_after_it(tmp_path, monkeypatch, signum):
    """A signal between the two renames of a replacing commit (old artifact moved aside, new one not yet in) is
    held until the swap is done: the new artifact is whole, no old or staging directory is left, then the handler
    the process had runs (the command line's: exit 143 / 129; Python's default for Ctrl-C: KeyboardInterrupt)."""
    import signal

    from k3c import termination

    out = _write(tmp_path / "art", plan={"arena_bytes": 1})
    monkeypatch.setattr(termination, "_requested", None)
    sig = getattr(signal, signum)
    handler = signal.default_int_handler if signum == "SIGINT" else lambda s, f: termination.request(s)
    before = signal.signal(sig, handler)
    real_rename = os.rename

    def rename_then_signal(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
            signal.raise_signal(sig)

    monkeypatch.setattr(A.os, "rename", rename_then_signal)
    try:
        with pytest.raises(KeyboardInterrupt if signum == "SIGINT" else SystemExit) as exc:
            _write(out, force=True, plan={"arena_bytes": 2})
    finally:
        signal.signal(sig, before)
    assert signum == "SIGINT" or exc.value.code == 128 + sig
    assert signal.getsignal(sig) is before
    assert read_artifact(out).plan == {"arena_bytes": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_bad_file_names_are_refused(tmp_path):
    with ArtifactWriter(tmp_path / "art") as w:
        for bad in ["../escape", "/abs", "manifest.json", "a//b", "./x", ""]:
            with pytest.raises(ArtifactError, match="plain relative path"):
                w.add_bytes(bad, b"")
        w.add_bytes("kernels/a", b"")
        with pytest.raises(ArtifactError, match="added twice"):
            w.add_bytes("kernels/a", b"")


def test_pack_is_deterministic_and_readable(tmp_path, monkeypatch):
    out = _write(tmp_path / "art")
    packed = pack(out)
    assert packed == tmp_path / "art.k3c"
    with tarfile.open(packed) as tar:
        members = tar.getmembers()
        assert [m.name for m in members][0] == "manifest.json"
        assert [m.name for m in members][1:] == sorted(m.name for m in members[1:])
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" for m in members)
    art = read_artifact(packed)
    assert art.plan["arena_bytes"] == 4096 and art.read_bytes("kernels/k0.cubin") == bytes(range(256))
    assert torch.equal(art.load_tensors("weights/rank0.safetensors")["idx"], _tensors()["idx"])
    with pytest.raises(ArtifactError, match="already exists"):
        pack(out)
    monkeypatch.chdir(out)                 # `k3c pack .` inside the artifact: beside it, named as it is
    assert pack(".", force=True) == tmp_path / "art.k3c"
    assert sorted(read_artifact(out).files) == sorted(read_artifact(packed).files)
    # a changed byte inside the archive is caught too
    data = bytearray(packed.read_bytes())
    pos = data.index(bytes(range(256)))
    data[pos + 10] ^= 0xFF
    packed.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="kernels/k0.cubin is corrupted"):
        read_artifact(packed)


def test_not_an_artifact(tmp_path):
    (tmp_path / "junk.k3c").write_bytes(b"hello")
    with pytest.raises(ArtifactError, match="not an artifact"):
        read_artifact(tmp_path / "junk.k3c")
    with pytest.raises(ArtifactError, match="no such artifact"):
        read_artifact(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="missing manifest.json"):
        read_artifact(tmp_path / "empty")


def test_failed_add_leaves_no_partial_file(tmp_path):
    with ArtifactWriter(tmp_path / "art") as w:
        with pytest.raises(ArtifactError, match="unsupported dtype"):
            w.add_tensors("weights/bad.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})
        w.add_json("plan.json", {})
        w.add_json("schedule.json", {})
        w.add_json("report.json", {})
        out = w.commit(**MANIFEST_FIELDS)
    assert read_artifact(out).files.keys() == {"build.json", "plan.json", "schedule.json", "report.json"}
    with pytest.raises(ArtifactError, match="already committed"):
        w.commit(**MANIFEST_FIELDS)


def test_runtime_module_imports_no_compiler_code():
    import ast
    import sys

    tree = ast.parse(open(A.__file__).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    third_party = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert third_party == {"torch", "safetensors", "safetensors.torch", "k3c", "k3c.atomic", "k3c.errors",
                           "k3c.runtime.encoding"}


def test_pack_from_the_command_line(tmp_path):
    # `k3c pack ART`: ART.k3c, byte-equal to the Python API's; a second pack refuses to overwrite it (one line,
    # exit 2) unless --force; -o naming a directory is refused before anything is written
    import subprocess
    import sys

    out = _write(tmp_path / "art")
    want = pack(out, tmp_path / "api.k3c")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "k3c.cli", "pack", *map(str, args)], capture_output=True,
                              text=True, timeout=300)

    r = cli(out)
    assert r.returncode == 0 and (tmp_path / "art.k3c").read_bytes() == want.read_bytes(), r.stderr
    r = cli(out)       # no -o given: the message names the default output, not -o
    assert r.returncode == 2 and "already exists (pass --force" in r.stderr
    assert r.stderr.startswith(f"error: the default output (pass -o) {tmp_path / 'art.k3c'}: ")
    r = cli(out, "-o", tmp_path / "art.k3c")
    assert r.returncode == 2 and r.stderr.startswith(f"error: -o {tmp_path / 'art.k3c'}: already exists")
    assert cli(out, "--force").returncode == 0
    r = cli(out, "-o", tmp_path)
    assert r.returncode == 2 and "is a directory; give a file name" in r.stderr
