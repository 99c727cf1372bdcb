"""Files that are replaced whole or not at all: the output of `k3c report`, `k3c inspect -o`, `k3c pack`.

Writing into the destination itself (open with truncation) loses the old file the moment the write starts; an
error, a full disk or a signal then leaves an empty or partial one. `replacing` writes a temporary file beside the
destination and renames it over the destination only when the writer finished (rename(2) within one directory is
atomic on POSIX file systems), under `termination.deferred`.
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from k3c import termination


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same directory, same suffix, a hidden name) for the block to write;
    when the block ends normally, rename it over `path`; however it ends, no temporary file stays. OSError from
    the rename propagates (the destination is then as it was)."""
    path = Path(path)
    tmp = path.parent / f".{path.stem}.tmp-{uuid.uuid4().hex[:16]}{path.suffix}"
    try:
        yield tmp
        with termination.deferred():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
