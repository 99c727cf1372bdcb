"""The launcher of the "triton" backend: each launch is a generated Python module of the artifact
(`kernels/<name>.py`, the kernel ABI of `k3c.ir.kernels`), imported once per session.

A module's text is read through the artifact (hash-checked) and written to the session's work directory first:
Triton reads a kernel's source from its file, and a .k3c archive has none. On a CUDA device the compiled kernels the
artifact ships for the running Triton and GPU (`k3c finalize`) are installed into Triton's cache first
(`k3c.runtime.kernel_cache`), so no kernel is compiled at load; `compiled_kernels` counts the files installed.
On a CPU device the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is imported).
A launch with planned scratch (schedule.json "scratch": name -> arena buffer, `k3c.passes.plan_memory`) gets the
arena views as `launch(inputs, outputs, sizes, scratch=...)`, so the kernel allocates nothing of its own.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from k3c.errors import ArtifactError
from k3c.runtime import kernel_cache
from k3c.runtime.launchers import Launcher


class TritonLauncher(Launcher):
    def __init__(self, art, device, launches: list[dict], workdir: Path):
        super().__init__(art, device, launches, workdir)
        if device.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
        self.compiled_kernels = kernel_cache.install(art, device) if device.type == "cuda" else 0
        if self.compiled_kernels:
            kernel_cache.warm_cache_key()
        self.kernels = {ln["name"]: _import_kernel(art, ln["module"], ln["name"], workdir)
                        for ln in sorted(launches, key=lambda ln: ln["name"])}

    def launch(self, frame, ln: dict) -> None:
        outs = [frame.out(n) for n in ln["outputs"]]
        for n, o in zip(ln["outputs"], outs):
            if o is None:
                raise ArtifactError(f"kernel {ln['name']} output {n} has no buffer in plan.json")
        ins = [frame.env[n].contiguous() for n in ln["inputs"]]
        if "scratch" not in ln:
            self.kernels[ln["name"]].launch(ins, outs, frame.sizes)
        else:
            self.kernels[ln["name"]].launch(ins, outs, frame.sizes, scratch=_scratch(frame, ln))
        frame.env.update(zip(ln["outputs"], outs))


def _scratch(frame, ln: dict) -> dict:
    """The launch's planned scratch buffers (schedule.json "scratch": name -> arena buffer) as arena views at the
    frame's sizes; raises ArtifactError for one plan.json does not place."""
    out = {}
    for key, buf in ln["scratch"].items():
        out[key] = frame.out(buf)
        if out[key] is None:
            raise ArtifactError(f"kernel {ln['name']} scratch {buf} has no buffer in plan.json")
    return out


def _import_kernel(art, rel: str, name: str, workdir: Path):
    """Import one generated kernel module of the artifact (module docstring)."""
    path = workdir / f"{name}.py"
    path.write_text(art.read_text(rel))
    modname = f"k3c_kernels_{workdir.name}_{name}"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # a generated module that does not import is a broken artifact
        raise ArtifactError(f"{rel}: the kernel module does not import ({type(e).__name__}: {e})") from e
    if not hasattr(mod, "launch"):
        raise ArtifactError(f"{rel}: the kernel module has no launch() function")
    return mod
