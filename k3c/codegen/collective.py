"""The collective backend: the IR's collectives (`k3c/ir/ops/collective.py`), one launch each, carried out on
torch.distributed by the runtime's collective launcher (`k3c.runtime.launchers.collective`). Generates no code;
the launch record carries the attrs and which of them are symbolic dims, like the library backend's."""

from __future__ import annotations

from k3c.codegen.backend import register_backend
from k3c.codegen.library import LibraryBackend
from k3c.runtime.launchers.collective import COLLECTIVE_OPS


@register_backend
class CollectiveBackend(LibraryBackend):
    name = "collective"
    ops = COLLECTIVE_OPS
