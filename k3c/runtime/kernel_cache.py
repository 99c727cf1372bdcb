"""Compiled Triton kernels shipped inside an artifact, so that loading it compiles nothing.

A generated kernel module calls its `@triton.jit` kernels as usual; Triton then looks the compiled kernel up in its
on-disk cache (`triton.knobs.cache.dir`, `TRITON_CACHE_DIR`) under a hash of the kernel source, its specialisation,
the compile options and the Triton version, and compiles (seconds per kernel) only on a miss. The artifact carries
the cache entries its kernels need, per Triton version and GPU architecture:

    kernels/cache/triton-<version>/sm_<major><minor>/<hash>/<kernel>.json      launch metadata (Triton's own)
    kernels/cache/triton-<version>/sm_<major><minor>/<hash>/<kernel>.cubin     the binary
    kernels/cache/triton-<version>/sm_<major><minor>/<hash>/__grp__<kernel>.json   the entry's file list
    kernels/cache/triton-<version>/sm_<major><minor>/<hash>/__triton_launcher<ext>  a launcher stub (host code)

hashed in the manifest like every file. `install(art, device)` (the Triton launcher, at load) copies the entries of
the running Triton and GPU into the process's cache directory, so each first launch is a cache hit: the cubin is
loaded, nothing is compiled. Triton's group files name their files by absolute path; the artifact stores bare file
names and `install` writes the paths of the directory it installs into. `capture()` makes a fresh cache directory
current for a block and `collect` reads back what Triton compiled into it (only the .json and the binary of each
entry: the intermediate IRs are not needed to launch), and the host-side shared objects Triton builds with the C
compiler on a kernel's first launch (one launcher stub per distinct kernel signature, and its driver helpers: a
quarter of a second each; 23 of them were 5.8 s of an 8.0 s first prefill of k3.1-pro-tiny on the H200). Those
are keyed by their C source and the platform, and named for the Python ABI (`EXT_SUFFIX`), so another Python or
platform never finds them and builds its own. `k3c.runtime.finalize` runs the kernels on the target and
adds the collected entries to the artifact. A cache entry is content-addressed, so installing into a shared
directory never changes a kernel another process uses.
Errors: ArtifactError (a corrupted entry, through the artifact's hash check).
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from k3c.atomic import temporary_sibling

PREFIX = "kernels/cache"
_GROUP = "__grp__"
_KEEP = (".json", ".cubin", ".hsaco")  # metadata, NVIDIA and AMD binaries: what `CompiledKernel` loads


def tag(device) -> str:
    """`triton-<version>/sm_<major><minor>`: the artifact folder of compiled kernels for `device` (a CUDA
    torch.device) and the running Triton."""
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return f"triton-{triton.__version__}/sm_{major}{minor}"


def shipped(files, device) -> list[str]:
    """The artifact files (relative paths among `files`) holding compiled kernels for `device` and this Triton."""
    prefix = f"{PREFIX}/{tag(device)}/"
    return sorted(f for f in files if f.startswith(prefix))


def cache_dir() -> Path:
    """Triton's current cache directory (`triton.knobs.cache.dir`, i.e. TRITON_CACHE_DIR or ~/.triton/cache)."""
    import triton

    return Path(triton.knobs.cache.dir)


def install(art, device) -> int:
    """Copy the artifact's compiled kernels for `device` and this Triton into Triton's cache directory (entries
    already there are kept); returns the number of files the artifact ships for them (0: none, kernels JIT)."""
    rels = shipped(art.files, device)
    root = cache_dir()
    prefix = f"{PREFIX}/{tag(device)}/"
    for rel in rels:
        entry, name = rel[len(prefix):].split("/", 1)
        dest = root / entry / name
        if dest.exists():
            continue
        data = art.read_bytes(rel)
        if name.startswith(_GROUP):  # bare names -> absolute paths in this directory (module docstring)
            group = json.loads(data)
            group["child_paths"] = {k: str(root / entry / v) for k, v in group["child_paths"].items()}
            data = json.dumps(group).encode()
        _write_atomic(dest, data)
    return len(rels)


def warm_cache_key() -> None:
    """Compute now the part of Triton's cache key that hashes Triton itself (its compiler sources and libtriton:
    about 0.4 s on the H200 host, once per process, `triton.runtime.cache.triton_key`), which the first launch of a
    kernel would otherwise pay inside the first prefill. The session calls it while the weights copy."""
    from triton.runtime import cache

    key = getattr(cache, "triton_key", None)  # memoised in Triton (functools.lru_cache)
    if key is not None:
        key()


@contextmanager
def capture():
    """Within the block, Triton compiles into (and reads from) a fresh empty cache directory, which is yielded
    (a Path) and deleted afterwards. Kernels already compiled in this process are not compiled again: import the
    kernel modules inside the block."""
    import shutil

    import triton

    knobs = triton.knobs.cache
    explicit = knobs.__dict__.pop("dir", None)  # a value set in Python wins over the environment
    before = os.environ.get("TRITON_CACHE_DIR")
    tmp = Path(tempfile.mkdtemp(prefix="k3c-triton-cache-"))
    os.environ["TRITON_CACHE_DIR"] = str(tmp)
    try:
        yield tmp
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
        if explicit is not None:
            knobs.__dict__["dir"] = explicit
        shutil.rmtree(tmp, ignore_errors=True)


def collect(root: Path, device) -> dict[str, bytes]:
    """The artifact files (relative path -> bytes) for the compiled kernels in cache directory `root`: per
    entry with a group file, its metadata and binary, and the group file with bare names; and the shared objects
    of the entries without a group file (launcher stubs, driver helpers) (module docstring). Group entries
    without a binary are skipped."""
    out: dict[str, bytes] = {}
    base = f"{PREFIX}/{tag(device)}"
    for so in sorted(root.glob("*/*.so")):
        if not any(so.parent.glob(f"{_GROUP}*.json")):
            out[f"{base}/{so.parent.name}/{so.name}"] = so.read_bytes()
    for grp in sorted(root.glob(f"*/{_GROUP}*.json")):
        children = json.loads(grp.read_text()).get("child_paths", {})
        keep = {k: Path(p).name for k, p in children.items() if k.endswith(_KEEP)}
        if not any(k.endswith(_KEEP[1:]) for k in keep):
            continue
        entry = grp.parent.name
        for name in sorted(keep.values()):
            out[f"{base}/{entry}/{name}"] = (grp.parent / name).read_bytes()
        out[f"{base}/{entry}/{grp.name}"] = json.dumps({"child_paths": dict(sorted(keep.items()))},
                                                       sort_keys=True).encode()
    return out


def _write_atomic(dest: Path, data: bytes) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(dest)
    tmp.write_bytes(data)
    os.replace(tmp, dest)
