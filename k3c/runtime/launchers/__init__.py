"""Launchers: how the runtime carries out one launch of `schedule.json`, one launcher per backend.

A launcher is built once per session with the launches of its backend (it loads their code: Triton modules, a TVM
shared library) and then runs them: `launch(frame, ln)` reads the inputs from the frame's bindings, writes the
outputs into their planned buffers (arena or pools) and binds them. The table below maps a backend name, as
`schedule.json` records it, to the launcher's module and class; the modules are imported only when an artifact
uses that backend, so a CPU artifact never imports Triton and a GPU artifact never imports tvm_ffi.
Raises ArtifactError for a backend this runtime does not know (an artifact from a newer compiler).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from k3c.errors import ArtifactError

#: backend name -> "module:Class" (or a function of the same arguments returning the launcher)
LAUNCHERS = {
    "triton": "k3c.runtime.launchers.triton:TritonLauncher",
    "tvm": "k3c.runtime.launchers.tvm:tvm_launcher",
    "library": "k3c.runtime.launchers.torch_ops:TorchOpLauncher",
    "view": "k3c.runtime.launchers.torch_ops:TorchOpLauncher",
    "collective": "k3c.runtime.launchers.collective:CollectiveLauncher",
}


class Launcher(ABC):
    """Base class: `__init__(art, device, launches, workdir)` prepares the launches of one backend (all entry
    points); `launch(frame, ln)` runs one of them on `frame` (`k3c.runtime.frame.Frame`)."""

    #: artifact files (relative path -> bytes) this launcher compiled at load, for `k3c finalize` to keep
    compiled: dict[str, bytes] = {}

    def __init__(self, art, device, launches: list[dict], workdir):
        self.device = device

    @abstractmethod
    def launch(self, frame, ln: dict) -> None:
        """Run launch `ln` on `frame`, binding its outputs."""


def make_launchers(art, device, schedule: dict, workdir) -> dict[str, Launcher]:
    """One launcher per backend used by `schedule` (entry -> {"launches": [...]}), keyed by backend name."""
    by_backend: dict[str, list[dict]] = {}
    for entry in schedule.values():
        for ln in entry["launches"]:
            by_backend.setdefault(ln["backend"], []).append(ln)
    out = {}
    for name in sorted(by_backend):
        if name not in LAUNCHERS:
            raise ArtifactError(f"schedule.json uses backend {name!r}, which this runtime cannot launch "
                                f"(it knows {', '.join(sorted(LAUNCHERS))})")
        mod, cls = LAUNCHERS[name].split(":")
        out[name] = getattr(importlib.import_module(mod), cls)(art, device, by_backend[name], workdir)
    return out
