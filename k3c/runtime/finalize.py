"""`k3c finalize ART`: compile an artifact's Triton kernels on the target GPU once and store them in the artifact.

The compiling machine may run another Triton than the GPU machine (or have no GPU), and Triton's binaries are valid
only for the Triton version and GPU architecture that built them. So the artifact is finalized where it runs: the
kernels are run on a warm-up workload with Triton compiling into a fresh cache directory
(`k3c.runtime.kernel_cache.capture`), and the compiled entries are added to the artifact under
`kernels/cache/triton-<version>/sm_<arch>/`, hashed in the manifest, the artifact replaced atomically (its other
files hard-linked, not copied). Later loads on a machine with that Triton and architecture install them and compile
nothing (`kernel_cache.install`). Kernels a launcher compiles at load (TVM's CUDA C -> one cubin,
`k3c.runtime.launchers.tvm_cuda`) are added the same way, from its `compiled` files.

Triton compiles one binary per specialisation of a kernel: its constexpr arguments (block sizes, split counts the
launcher derives from the sizes) and whether integer arguments equal 1 or are multiples of 16. The warm-up covers
what a session meets: for the batch sizes {1, max_batch}, full prefill chunks (max_prefill tokens) and short odd
ones at contexts 0, 1, 2, 4, ... up to the longest (the kernels switch forms with the context, e.g. DSA's sparse
attention once it exceeds index_topk keys), and decode steps (the first eager, capturing the CUDA graphs, the others
replaying them) at context lengths from 0 growing by 1.25x up to max_seq (the cache contents do not matter for
compiling; the length is set directly). A size outside them compiles on first use, as without a
finalize (then Triton's own cache keeps it).
Errors: ArtifactError (not an artifact directory; a .k3c archive must be unpacked or finalized before packing),
RuntimeInputError (no CUDA device).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from k3c.errors import ArtifactError, RuntimeInputError
from k3c.runtime import kernel_cache
from k3c.runtime.artifact import BUILD, ArtifactWriter, read_artifact


def finalize(path: str | os.PathLike, device: str = "cuda") -> dict:
    """Finalize the artifact directory `path` for `device` (module docstring); returns `finalize_session`'s
    summary."""
    from k3c.runtime.session import Session

    if not torch.cuda.is_available():
        raise RuntimeInputError("finalize compiles kernels for the GPU they run on: this machine has no CUDA GPU")
    dev = torch.device(device)
    if kernel_cache.shipped(read_artifact(path, verify=False).files, dev):  # without loading the weights
        return {"tag": kernel_cache.tag(dev), "files": 0, "bytes": 0, "seconds": 0.0, "skipped": True}
    return finalize_session(Session(path, dev))


def finalize_session(session) -> dict:
    """Finalize the artifact of a freshly loaded CUDA `session` (no kernel launched yet) with it, then reset it.
    Returns {"tag", "files", "bytes" (added), "seconds", "skipped" (it already held this Triton's and GPU's
    kernels)}. Used by `finalize` and `k3c.load(..., finalize=True)`."""
    t0, dev = time.perf_counter(), session.device
    if kernel_cache.shipped(session.artifact_files, dev):
        return {"tag": kernel_cache.tag(dev), "files": 0, "bytes": 0, "seconds": 0.0, "skipped": True}
    with kernel_cache.capture() as root:
        warm_up(session)
        files = kernel_cache.collect(root, dev)
    for launcher in session.launchers.values():  # e.g. the cubin of TVM's CUDA kernels, compiled at load
        files.update(launcher.compiled)
    add_files(session.path, files)
    session.artifact_files = read_artifact(session.path, verify=False).files
    return {"tag": kernel_cache.tag(dev), "files": len(files), "bytes": sum(map(len, files.values())),
            "seconds": time.perf_counter() - t0, "skipped": False}


def warm_up_lengths(start: int, max_seq: int, ratio: float = 1.25) -> list[int]:
    """Context lengths for the decode warm-up: `start`, then growing by `ratio` (at least 1 token), and the
    longest a decode step can have (max_seq - 1); ascending, distinct, all in [start, max_seq - 1]
    (e.g. 0, 1, ..., 5, 6, 7, 8, 10, 12, 15, 18, ... for ratio 1.25)."""
    out, L = [], start
    while L < max_seq - 1:
        out.append(L)
        L = max(L + 1, int(L * ratio))
    return out + [max_seq - 1] if start <= max_seq - 1 else out


@torch.no_grad()
def warm_up(session) -> None:
    """Run every entry of `session` at the sizes of the module docstring; leaves the session reset."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda B, T: torch.randint(0, session.vocab, (B, T), generator=gen)  # noqa: E731
    T0, T1 = min(session.max_prefill, session.max_seq - 1), min(17, session.max_prefill)
    for B in sorted({1, session.max_batch}):
        for T in sorted({T0, T1} - {1}):  # a full and an odd chunk at contexts 0, 1, 2, 4, ... up to the longest
            for L in warm_up_lengths(0, session.max_seq - T, ratio=2.0):
                session.reset()
                session.length, session.batch = L, B
                session.prefill(rand(B, T))
        if "prefill_all" in session.schedule and T0 > 1:
            session.reset()
            session.prefill(rand(B, T0), logits="all")
        session.reset()
        for L in warm_up_lengths(0, session.max_seq):
            session.length, session.batch = L, B  # the cache contents do not matter for compiling
            session.decode(rand(B, 1))
    session.reset()


def add_files(path: Path, files: dict[str, bytes]) -> None:
    """Add `files` (relative path -> bytes) to the artifact directory `path`, replacing it atomically: a new
    directory with the old files hard-linked and the new ones written, a new manifest, renamed in. Raises
    ArtifactError for a file the artifact already has."""
    if not path.is_dir():
        raise ArtifactError(f"{path}: finalize amends an artifact directory (unpack a .k3c first)")
    art = read_artifact(path, verify=False)
    clash = sorted(set(files) & set(art.files))
    if clash:
        raise ArtifactError(f"{path}: already has {clash[0]}")
    m = art.manifest
    with ArtifactWriter(path, force=True) as writer:
        for rel, sha in sorted(art.files.items()):
            if rel != BUILD:  # commit writes build.json anew from the same manifest fields
                writer.add_existing(rel, path / rel, sha)
        for rel, data in sorted(files.items()):
            writer.add_bytes(rel, data)
        writer.commit(config=m["config"], target=m["target"], tp=m["tp"], bounds=m["bounds"],
                      entry_points=m["entry_points"], extra=m.get("extra"))
