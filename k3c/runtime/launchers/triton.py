"""The launcher of the "triton" backend: each launch is a generated Python module of the artifact
(`kernels/<name>.py`, the kernel ABI of `k3c.ir.kernels`), imported once per session.

A module's text is read through the artifact (hash-checked) and written to the session's work directory first:
Triton reads a kernel's source from its file, and a .k3c archive has none. On a CUDA device the compiled kernels the
artifact ships for the running Triton and GPU (`k3c finalize`) are installed into Triton's cache first
(`k3c.runtime.kernel_cache`), so no kernel is compiled at load; `compiled_kernels` counts the files installed.
On a CPU device the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is imported).
Inputs reach a module as they are when it declares `TAKES_VIEWS` (it indexes strided views itself), else contiguous.
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
        self.takes_views = {name for name, mod in self.kernels.items() if getattr(mod, "TAKES_VIEWS", False)}
        #: planned bytes of each scratch buffer (plan.json): a call's view must fit them
        mine = {buf for ln in launches for buf in ln.get("scratch", {}).values()}
        self.scratch_bytes = {buf: b["bytes"] for a in art.plan["arena"].values() for buf, b in a["buffers"].items()
                              if buf in mine}

    def launch(self, frame, ln: dict) -> None:
        outs = [frame.out(n) for n in ln["outputs"]]
        for n, o in zip(ln["outputs"], outs):
            if o is None:
                raise ArtifactError(f"kernel {ln['name']} output {n} has no buffer in plan.json")
        ins = [frame.env[n] for n in ln["inputs"]]
        if ln["name"] not in self.takes_views:
            ins = [t.contiguous() for t in ins]
        if "scratch" not in ln:
            self.kernels[ln["name"]].launch(ins, outs, frame.sizes)
        else:
            self.kernels[ln["name"]].launch(ins, outs, frame.sizes, scratch=self.scratch(frame, ln))
        frame.env.update(zip(ln["outputs"], outs))

    def scratch(self, frame, ln: dict) -> dict:
        """The launch's planned scratch buffers (schedule.json "scratch": name -> arena buffer) as arena views at the
        frame's sizes; raises ArtifactError for one plan.json does not place or one larger at these sizes than at
        the bounds it was planned at (a declaration that is not monotone in B, T, L: it would overlap others)."""
        out = {}
        for key, buf in ln["scratch"].items():
            t = out[key] = frame.out(buf)
            if t is None or t.numel() * t.element_size() > self.scratch_bytes[buf]:
                raise ArtifactError(f"kernel {ln['name']} scratch {buf}: " + (
                    "no buffer in plan.json" if t is None else
                    f"{t.numel() * t.element_size()} bytes at {frame.sizes}, planned {self.scratch_bytes[buf]}"))
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
