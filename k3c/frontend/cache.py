"""An on-disk memo of imported graphs: a model this k3c has imported before is read back instead of exported again.

The import of a full-size model spends most of its time importing and running torch.export (about 6 of the
10 CPU seconds of `k3c inspect k3.1-pro`); its result is a function of the model's config and parameter types,
the entry point and logits mode, and the code that computes it. So the graph is stored as k3c IR JSON
(`k3c.ir.serialize`, an exact round trip) under a key that hashes all of them:
- the import's inputs: the config (`K3Config.raw` and name), the entry, the logits mode, and the parameters'
  names, dtypes and shapes (`"meta"` for a model built from its config by `build_meta_model`);
- the code: every file under `models/`, `k3c/frontend/` and `k3c/ir/` (the reference model, the exporter and
  importer, the op registry that infers types), and the versions of Python, torch and sympy.
Editing any of that code or upgrading torch gives new keys: a stale graph is never read. Files are written
atomically (a temporary file, then `os.replace`); an unreadable one is ignored and written again; the oldest files
beyond `MAX_FILES` are deleted.

Location: `$K3C_CACHE_DIR`, else `$XDG_CACHE_HOME/k3c`, else `~/.cache/k3c`; `K3C_CACHE_DIR=off` (or empty) turns
the memo off (the test suite runs with it off, so every test exercises the importer).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable

from k3c.errors import IRError
from k3c.ir import serialize
from k3c.ir.graph import Graph

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("models", "k3c/frontend", "k3c/ir")
MAX_FILES = 32  # ~5 MB per full-size entry point


def cache_dir() -> Path | None:
    """The memo's directory, or None when `K3C_CACHE_DIR` is `off` or empty."""
    env = os.environ.get("K3C_CACHE_DIR")
    if env is not None:
        return None if env.strip() in ("", "off") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k3c"


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of the code an import depends on (see the module docstring), computed once per process."""
    import sympy
    import torch

    h = hashlib.sha256(f"{sys.version}|torch {torch.__version__}|sympy {sympy.__version__}".encode())
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".json"):
                h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def key(config_raw: dict, name: str, params: list | str, entry: str, logits: str, kda_state: str = "f32",
        dsa_index_keys: str = "bf16") -> str:
    """The memo key of one import: `params` is [(name, dtype, shape)] of the model's parameters, or "meta";
    `kda_state` the KDA state's storage dtype, `dsa_index_keys` the DSA index keys'."""
    doc = json.dumps({"config": config_raw, "name": name, "params": params, "entry": entry, "logits": logits,
                      "kda_state": kda_state,
                      "dsa_index_keys": dsa_index_keys, "code": code_digest()}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def memoized(key_: str, build: Callable[[], Graph]) -> tuple[Graph, bool]:
    """(the graph stored under `key_`, True), or (build(), False) after storing it; `build` alone when off."""
    where = cache_dir()
    if where is None:
        return build(), False
    path = where / f"import-{key_}.json"
    if path.is_file():
        try:
            return serialize.load(path), True
        except (IRError, OSError, KeyError, TypeError, ValueError):  # truncated or foreign: import again
            pass
    graph = build()
    try:
        _store(where, path, serialize.dumps(graph))
    except OSError:  # an unwritable cache directory costs the memo, not the import
        pass
    return graph, False


def _store(where: Path, path: Path, text: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=where, prefix=".import-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    files = sorted(where.glob("import-*.json"), key=lambda p: p.stat().st_mtime)
    for old in files[:-MAX_FILES]:
        old.unlink(missing_ok=True)
