"""Compiled kernels in the artifact (`k3c.runtime.kernel_cache`, `k3c.runtime.finalize`): collecting Triton's cache
entries, amending an artifact atomically, installing the entries for a later load (CPU, on a Triton cache directory
laid out as Triton writes it); and on a GPU, that a finalized artifact loads and runs without compiling a kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k3c.errors import ArtifactError
from k3c.runtime import kernel_cache
from k3c.runtime.artifact import ArtifactWriter, read_artifact
from k3c.runtime.finalize import add_files, warm_up, warm_up_lengths

TAG = "triton-3.6.0/sm_90"


def _fake_triton_cache(root):
    """Two kernel entries as Triton writes them (every stage's file, a group file with absolute paths), a
    driver-helper entry and a launcher-stub entry (a shared object each, no group), and a group entry without a
    binary."""
    for h, name in (("a" * 8, "k_add"), ("b" * 8, "k_norm")):
        d = root / h
        d.mkdir(parents=True)
        exts = ("source", "ttir", "ttgir", "llir", "ptx", "cubin")
        files = {f"{name}.{ext}": f"{name} {ext}".encode() for ext in exts}
        files[f"{name}.json"] = json.dumps({"name": name, "num_warps": 4}).encode()
        for f, data in files.items():
            (d / f).write_bytes(data)
        (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {f: str(d / f) for f in files}}))
    (root / ("c" * 8)).mkdir()
    (root / ("c" * 8) / "cuda_utils.so").write_bytes(b"\x7fELF")
    (root / ("d" * 8)).mkdir()
    (root / ("d" * 8) / "__triton_launcher.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF launcher")
    (root / ("e" * 8)).mkdir()
    (root / ("e" * 8) / "__grp__k_none.json").write_text(json.dumps({"child_paths": {"k_none.source": "x"}}))


def _artifact(out):
    with ArtifactWriter(out) as w:
        for f in ("plan.json", "schedule.json", "report.json"):
            w.add_json(f, {"file": f})
        w.add_tensors("weights/params.safetensors", {"w": torch.arange(6.0)})
        w.commit(config={"vocab_size": 8}, target={"name": "h200"}, tp=1, bounds={"max_batch": 1}, entry_points={},
                 extra={"dtype": "bf16"})
    return out


@pytest.fixture
def tagged(monkeypatch):
    monkeypatch.setattr(kernel_cache, "tag", lambda device: TAG)


def test_collect_keeps_metadata_and_binary_with_bare_names(tmp_path, tagged):
    _fake_triton_cache(tmp_path / "cache")
    files = kernel_cache.collect(tmp_path / "cache", "cuda")
    base = f"kernels/cache/{TAG}/{'a' * 8}"
    assert sorted(f for f in files if f.startswith(base)) == [f"{base}/__grp__k_add.json", f"{base}/k_add.cubin",
                                                              f"{base}/k_add.json"]
    assert len(files) == 8  # and the driver helper and launcher stub (built by the C compiler at a first launch)
    assert files[f"kernels/cache/{TAG}/{'d' * 8}/__triton_launcher.cpython-312-x86_64-linux-gnu.so"] == \
        b"\x7fELF launcher"
    assert files[f"kernels/cache/{TAG}/{'c' * 8}/cuda_utils.so"] == b"\x7fELF"
    assert json.loads(files[f"{base}/__grp__k_add.json"]) == {"child_paths": {"k_add.cubin": "k_add.cubin",
                                                                              "k_add.json": "k_add.json"}}
    assert files[f"{base}/k_add.cubin"] == b"k_add cubin"


def test_add_files_then_install_round_trip(tmp_path, tagged, monkeypatch):
    art_dir = _artifact(tmp_path / "art")
    before = read_artifact(art_dir).files
    weights_inode = os.stat(art_dir / "weights/params.safetensors").st_ino
    _fake_triton_cache(tmp_path / "cache")
    files = kernel_cache.collect(tmp_path / "cache", "cuda")
    add_files(art_dir, files)
    art = read_artifact(art_dir)  # every file hash-checked, the new ones listed in the manifest
    assert art.files.items() >= before.items() and set(art.files) - set(before) == set(files)
    assert art.manifest["extra"] == {"dtype": "bf16"} and art.manifest["config"] == {"vocab_size": 8}
    assert os.stat(art_dir / "weights/params.safetensors").st_ino == weights_inode  # linked, not copied
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art")]  # no staging directory left
    assert kernel_cache.shipped(art.files, "cuda") == sorted(files)
    with pytest.raises(ArtifactError, match="already has"):
        add_files(art_dir, files)

    target = tmp_path / "triton-home"
    monkeypatch.setattr(kernel_cache, "cache_dir", lambda: target)
    assert kernel_cache.install(art, "cuda") == 8
    assert (target / ("d" * 8) / "__triton_launcher.cpython-312-x86_64-linux-gnu.so").read_bytes() == \
        b"\x7fELF launcher"
    grp = json.loads((target / ("b" * 8) / "__grp__k_norm.json").read_text())["child_paths"]
    assert grp == {"k_norm.cubin": str(target / ("b" * 8) / "k_norm.cubin"),
                   "k_norm.json": str(target / ("b" * 8) / "k_norm.json")}
    assert all(open(p, "rb").read() == files[f"kernels/cache/{TAG}/{'b' * 8}/{os.path.basename(p)}"]
               for p in grp.values())


def test_install_ships_nothing_for_another_triton(tmp_path, tagged, monkeypatch):
    art_dir = _artifact(tmp_path / "art")
    add_files(art_dir, {f"kernels/cache/{TAG}/{'a' * 8}/k.cubin": b"x"})
    monkeypatch.setattr(kernel_cache, "tag", lambda device: "triton-3.9.0/sm_90")
    monkeypatch.setattr(kernel_cache, "cache_dir", lambda: tmp_path / "triton-home")
    assert kernel_cache.install(read_artifact(art_dir), "cuda") == 0
    assert not (tmp_path / "triton-home").exists()


def test_capture_points_triton_at_a_fresh_directory_and_restores(monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    with kernel_cache.capture() as root:
        assert root.is_dir() and not any(root.iterdir())
        assert str(kernel_cache.cache_dir()) == str(root)
    assert not root.exists() and os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"


def test_add_files_refuses_an_archive(tmp_path):
    (tmp_path / "a.k3c").write_bytes(b"")
    with pytest.raises(ArtifactError, match="artifact directory"):
        add_files(tmp_path / "a.k3c", {"kernels/cache/x": b""})


@pytest.mark.parametrize("start, max_seq", [(0, 4096), (100, 131072), (5, 7), (6, 7)])
def test_warm_up_lengths_cover_the_context_geometrically(start, max_seq):
    Ls = warm_up_lengths(start, max_seq)
    assert Ls[0] == start and Ls[-1] == max_seq - 1 and Ls == sorted(set(Ls))
    assert all(b <= max(a + 1, int(a * 1.25)) for a, b in zip(Ls, Ls[1:]))


class _Recorder:
    """A session stand-in that records the (entry, B, T, L) of each call `warm_up` makes."""

    def __init__(self, max_batch, max_seq, max_prefill, all_logits):
        self.max_batch, self.max_seq, self.max_prefill, self.vocab = max_batch, max_seq, max_prefill, 11
        self.schedule = {"prefill": {}, "decode": {}, **({"prefill_all": {}} if all_logits else {})}
        self.calls, self.length, self.batch = [], 0, None

    def reset(self):
        self.length, self.batch = 0, None

    def _call(self, entry, tokens):
        B, T = tokens.shape
        assert self.batch in (None, B) and self.length + T <= self.max_seq and int(tokens.max()) < self.vocab
        self.calls.append((entry, B, T, self.length))
        self.batch, self.length = B, self.length + T

    def prefill(self, tokens, logits="last"):
        self._call("prefill" if logits == "last" else "prefill_all", tokens)

    def decode(self, tokens):
        self._call("decode", tokens)


@pytest.mark.parametrize("max_batch, max_seq, max_prefill, all_logits", [(8, 4096, 640, True), (1, 80, 32, False)])
def test_warm_up_meets_each_batch_chunk_and_context_kind(max_batch, max_seq, max_prefill, all_logits):
    s = _Recorder(max_batch, max_seq, max_prefill, all_logits)
    warm_up(s)
    assert s.length == 0 and s.batch is None
    for B in {1, max_batch}:
        pre = {(T, L) for e, b, T, L in s.calls if e == "prefill" and b == B}
        full = min(max_prefill, max_seq - 1)
        for T in (full, 17):  # a full and an odd chunk on an empty cache, at an odd context, a multiple of 16
            assert {(T, 0), (T, 1), (T, 16), (T, max_seq - T - 1)} <= pre  # and the longest context it fits in
        dec = sorted(L for e, b, T, L in s.calls if e == "decode" and b == B)
        assert dec == [0, max_seq - 1]  # an eager step and a replay: decode kernels do not change with the context
        assert any(e == "prefill_all" and b == B for e, b, _, _ in s.calls) == all_logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_finalized_artifact_loads_without_compiling(tmp_path):
    import k3c
    from k3c.compile import CompileOptions, compile_model
    from k3c.runtime.finalize import finalize
    from models.config import K3Config
    from models.k3 import save_random_checkpoint

    save_random_checkpoint(K3Config.from_pretrained("k3.1-pro-tiny"), tmp_path / "ckpt", seed=4, dtype=torch.float32)
    opts = CompileOptions(str(tmp_path / "ckpt"), tmp_path / "art", target="h200", max_batch=2, max_seq=256,
                          max_prefill=64, dtype="bf16")
    compile_model(opts)
    r = finalize(opts.out)
    assert r["files"] > 0 and not r["skipped"] and finalize(opts.out)["skipped"]
    script = textwrap.dedent(f"""
        import pathlib, torch, k3c
        s = k3c.load({str(opts.out)!r}, "cuda")
        t = torch.arange(64, dtype=torch.long).reshape(1, 64) % s.vocab
        out = [s.prefill(t)] + [s.decode(t[:, :1]) for _ in range(3)]
        torch.save(torch.cat(out, 1).float().cpu(), {str(tmp_path / 'logits.pt')!r})
        print(sorted({{p.suffix for p in pathlib.Path({str(tmp_path / 'fresh')!r}).rglob('*') if p.is_file()}}))
    """)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "fresh")}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    suffixes = res.stdout.strip().splitlines()[-1]
    assert ".llir" not in suffixes and ".ttir" not in suffixes and ".cubin" in suffixes, suffixes  # nothing compiled
    s = k3c.load(opts.out, "cuda", cuda_graphs=False)
    t = torch.arange(64, dtype=torch.long).reshape(1, 64).cuda() % s.vocab
    want = torch.cat([s.prefill(t)] + [s.decode(t[:, :1]) for _ in range(3)], 1).float().cpu()
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, rtol=0, atol=0)
