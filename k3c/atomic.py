"""Files that are replaced whole or not at all: the output of `k3c report`, `k3c inspect -o`, `k3c pack`.

Writing into the destination itself (open with truncation) loses the old file the moment the write starts; an
error, a full disk or a signal then leaves an empty or partial one. `replacing` writes a temporary file beside the
destination and renames it over the destination only when the writer finished (rename(2) within one directory is
atomic on POSIX file systems), under `termination.deferred`.

Temporary names (`temporary_sibling`, also the artifact writer's staging directory) are hidden, in the target's
directory, and short whatever the target's name: a long target name that fits its file system must not fail at the
end because its temporary name, a few dozen bytes longer, does not.
"""

from __future__ import annotations

import os
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from k3c import termination
from k3c.errors import K3CError

#: bytes in one path component when the file system does not tell (POSIX NAME_MAX of ext4, xfs, btrfs, tmpfs)
NAME_MAX = 255
_KEPT = 32     # bytes of the target's name a temporary name keeps, to tell whose it is
_RANDOM = 12   # hex digits of a temporary name: 48 random bits, so concurrent writers in one directory differ
_SUFFIX = 16   # bytes of the target's suffix kept (`.html`, `.onnx`: a writer may infer the format from it)


def name_max(directory: str | os.PathLike) -> int:
    """The longest file name, in bytes, that `directory`'s file system allows (pathconf's NAME_MAX); NAME_MAX (255)
    when it cannot tell (no such directory, no limit, no pathconf)."""
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return NAME_MAX
    return limit if limit > 0 else NAME_MAX


def name_too_long(path: str | os.PathLike) -> str | None:
    """Why `path`'s last component cannot be created in its directory ("its file name is N bytes, ..."), or None
    when its length (bytes in the file system encoding) is within `name_max` of the directory."""
    path = Path(path)
    size, limit = len(os.fsencode(path.name)), name_max(path.parent)
    return f"its file name is {size} bytes long, and {path.parent} allows at most {limit}" if size > limit else None


def _cut(text: str, size: int) -> str:
    """The longest prefix of `text` of at most `size` bytes in the file system encoding (whole characters)."""
    text = text[:max(size, 0)]
    while len(os.fsencode(text)) > size:
        text = text[:-1]
    return text


def temporary_sibling(path: str | os.PathLike, tag: str = "tmp", keep_suffix: bool = True) -> Path:
    """A fresh hidden path in `path`'s directory for a file or directory that is then renamed over `path`:
    `.{name}.{tag}-{12 random hex digits}{suffix}`, where suffix is path's suffix (with `keep_suffix`, when at most
    16 bytes) and name the first 32 bytes of the rest of path's name. At most 66 bytes with tag "tmp", whatever
    the length of path's name (and never more than its directory's `name_max`). Creates nothing."""
    path = Path(path)
    suffix = path.suffix if keep_suffix and len(os.fsencode(path.suffix)) <= _SUFFIX else ""
    base = path.name[:len(path.name) - len(suffix)] if suffix else path.name
    end = f".{tag}-{uuid.uuid4().hex[:_RANDOM]}{suffix}"
    room = min(_KEPT, name_max(path.parent) - 1 - len(os.fsencode(end)))
    return path.parent / f".{_cut(base, room)}{end}"


def _about_temporary(err: OSError, tmp: Path) -> bool:
    """Whether `err` is about the temporary file: it names it, or names no file (a write's ENOSPC, EIO)."""
    names = [n for n in (err.filename, err.filename2) if n is not None]
    return not names or any(isinstance(n, (str, bytes, os.PathLike)) and os.fsdecode(n) == str(tmp) for n in names)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same directory, same suffix, a short hidden name: `temporary_sibling`)
    for the block to write; when the block ends normally, give it the permission bits of the file it replaces (a
    new file keeps those the writer created it with) and rename it over `path`; however it ends, no temporary file
    stays. A symbolic link `path` is written through: the file it resolves to is replaced (the temporary file is
    beside that file), the link stays.

    Raises K3CError naming `path`, never the temporary file: before the block, when path's file name is longer
    than its file system allows; after it, for an OSError of the block about the temporary file (one naming it,
    or naming no file: a full disk) and for one of the final chmod or rename (the destination is then as it was).
    Other exceptions of the block propagate unchanged."""
    path = Path(path)
    why = name_too_long(path)          # first: lstat of such a name fails too
    target = Path(os.path.realpath(path)) if not why and path.is_symlink() else path
    why = why or name_too_long(target)  # a link to a name too long
    if not why and not target.parent.is_dir():       # a link whose target lies under a file or nowhere
        why = f"{target.parent} " + ("is not a directory" if target.parent.exists() else "does not exist")
    if why:
        raise K3CError(f"cannot write {path}: {why}")
    tmp = temporary_sibling(target)
    try:
        try:
            yield tmp
        except OSError as err:
            if not _about_temporary(err, tmp):
                raise
            raise K3CError(f"cannot write {path}: {err.strerror or err}") from None
        try:
            try:
                mode = stat.S_IMODE(os.stat(target).st_mode)
            except FileNotFoundError:
                mode = None
            if mode is not None:
                os.chmod(tmp, mode)
            with termination.deferred():
                os.replace(tmp, target)
        except OSError as err:
            raise K3CError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:     # never created where no directory is (a link into a file): nothing to remove
            pass
