"""The backend interface: who implements a kernel group, what goes into the artifact, which launcher runs it.

A backend is one way a launch can be carried out. Code-generating backends (Triton for GPUs, TVM for CPUs through
LLVM and CUDA source for retargeting) emit kernels into the artifact; the "library" backend leaves a GEMM, an
embedding or another single op to torch at run time; the "view" backend performs layout ops on tensor views. Each
backend

- `claims(kind, nodes)`: whether it can implement a proposed group (`form_kernels` proposes the fusion, e.g. a
  pointwise chain, then asks the context's backends in claim order; the first that claims it gets it);
- `emit(groups, ctx)`: the artifact files for all its groups of the artifact at once (`kernels/<name>.py` per
  Triton kernel; one shared library for TVM) and a sidecar row per group;
- `launch_record(group)`: what `schedule.json` stores for one of its launches beyond the common fields (name,
  backend, kind, inputs, outputs, scratch), read by the runtime launcher named `backend.name`
  (`k3c.runtime.launchers`);
- `scratch(group, ctx)`: the scratch buffers one launch of the group needs for its duration (`ScratchSpec`s, shapes
  symbolic in the bounds B, T, L), known before `plan_memory` runs: the pass places them in the arena, live for that
  launch only, so the static plan counts them and the runtime hands them to the launcher instead of the kernel
  allocating at run time. Scratch belongs to an implementation (Triton's grouped MoE GEMMs need h and per-slot
  outputs, a library op none), hence to the backend.
- `weight_layouts(group)`: weights (value name -> layout name) its kernels read in an order of their own rather
  than the checkpoint's; `schedule.json` records them per launch and the runtime re-lays each weight once on its
  device at load (`k3c.runtime.layouts`), so the artifact keeps the checkpoint's bytes.

The claim order comes from the target (`Target.backends`, by kind: GPUs generate Triton, CPUs TVM) with the
`--backend` preference moved to the front. Adding a backend: one package under `k3c/codegen/` registering a
`Backend` subclass with `@register_backend`, one launcher under `k3c/runtime/launchers/`; no pass changes.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from k3c.errors import ConfigError, UnsupportedError
from k3c.ir.graph import Node
from k3c.ir.kernels import KernelGroup
from k3c.ir.types import TensorType

#: Claim order per target kind when a target names none (`Target.backends` overrides).
DEFAULT_ORDER = {"cuda": ("triton", "library", "view"), "rocm": ("triton", "library", "view"),
                 "cpu": ("tvm", "library", "view")}
#: Backends every target has, after its own order: collectives have one implementation (torch.distributed).
ALWAYS = ("collective",)
#: Modules that define the known backends (imported on first use, so the registry fills lazily).
MODULES = {"triton": "k3c.codegen.triton.backend", "tvm": "k3c.codegen.tvm.backend",
           "library": "k3c.codegen.library", "view": "k3c.codegen.library", "collective": "k3c.codegen.collective"}


@dataclass
class Emission:
    """What a backend adds to the artifact: files (relative path -> text or bytes) and `index` rows
    (group name -> JSON data, merged into `kernels/index.json`)."""

    files: dict[str, str | bytes] = field(default_factory=dict)
    index: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class ScratchSpec:
    """One scratch buffer of a launch: `name` (unique within the launch; the key the launch function receives it
    under) and `type` (shape in the graph's dims, symbolic in B, T, L; dtype). Sized at the compile bounds by
    `plan_memory`, at the call's sizes by the runtime (`k3c.runtime.frame`)."""

    name: str
    type: TensorType

    def buffer(self, launch: str) -> str:
        """Its arena buffer's name (plan.json, schedule.json) for launch `launch`: `<launch>.scratch.<name>`, which no
        IR value has (launch names are `k<index>_<kind>`, `k3c.ir.kernels.group_name`)."""
        return f"{launch}.scratch.{self.name}"


class Backend(ABC):
    """Base class of backends (see the module docstring). Subclasses set `name`, `generates` and implement
    `claims`; code generators also `emit`; `launch_record` defaults to no extra fields, `scratch` to none."""

    name: str = ""
    generates: bool = False  # writes kernels into the artifact

    def __init__(self, target):
        self.target = target

    @abstractmethod
    def claims(self, kind: str, nodes: list[Node]) -> bool:
        """Whether this backend implements a launch of `kind` made of `nodes`."""

    def why_not(self, kind: str, nodes: list[Node]) -> str | None:
        """Why this backend does not claim a launch it might be expected to (a dtype it has no kernels for, ...),
        for the error when no backend claims it; None: nothing to add."""
        return None

    def emit(self, groups: list[KernelGroup], ctx) -> Emission:
        """Artifact files for `groups` (all of this backend's groups of the artifact, every entry point)."""
        return Emission()

    def launch_record(self, group: KernelGroup) -> dict:
        return {}

    def scratch(self, group: KernelGroup, ctx) -> list[ScratchSpec]:
        """The scratch buffers one launch of `group` needs (module docstring); `ctx`: the entry's CompileContext."""
        return []

    def weight_layouts(self, group: KernelGroup) -> dict[str, str]:
        """Weights of `group`'s inputs its kernels read in a load-time layout (value name -> a layout name of
        `k3c.runtime.layouts.LAYOUTS`; module docstring); none by default."""
        return {}

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator registering backend `cls` under `cls.name`; raises UnsupportedError for a second class
    of the same name."""
    prev = _REGISTRY.get(cls.name)
    if prev is not None and prev.__qualname__ != cls.__qualname__:
        raise UnsupportedError(f"backend {cls.name!r} is registered twice ({prev.__module__}, {cls.__module__})")
    _REGISTRY[cls.name] = cls
    return cls


def backend_class(name: str) -> type[Backend]:
    """The registered backend class `name`; raises ConfigError naming the known backends."""
    if name not in _REGISTRY and name in MODULES:
        importlib.import_module(MODULES[name])
    if name not in _REGISTRY:
        raise ConfigError(f"unknown backend {name!r} (known: {', '.join(sorted(MODULES))})")
    return _REGISTRY[name]


def claim_order(target, preferred: str | None = None) -> tuple[str, ...]:
    """Backend names in the order they may claim groups on `target`: the target's own order (`Target.backends`,
    else `DEFAULT_ORDER` by kind) with `preferred` first and `ALWAYS` last. Raises ConfigError for a name in the
    target's list that no backend has, or a preferred backend that is unknown or generates no code (library,
    view, collective), naming those that do."""
    order = tuple(getattr(target, "backends", ()) or DEFAULT_ORDER[target.kind])
    for name in order:
        if name not in MODULES:     # a target file's own list (targets.target_from_dict checks only its form)
            raise ConfigError(f"target {target.name}: field 'backends': unknown backend {name!r} "
                              f"(known: {', '.join(sorted(MODULES))})")
    order += tuple(n for n in ALWAYS if n not in order)
    if preferred is not None:
        if preferred not in MODULES or not backend_class(preferred).generates:     # --backend: what a user may pick
            raise ConfigError(f"--backend {preferred}: expected a code-generating backend "
                              f"({', '.join(n for n in MODULES if backend_class(n).generates)})")
        order = (preferred,) + tuple(n for n in order if n != preferred)
    return order


def backends_for(target, preferred: str | None = None) -> list[Backend]:
    """Backend instances for `target` in claim order (`claim_order`)."""
    return [backend_class(n)(target) for n in claim_order(target, preferred)]
