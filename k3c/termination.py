"""Termination requests (SIGTERM) that foreign code cannot lose, and commits they cannot tear.

A Python signal handler raises in whichever frame is running. When that frame is a Python callback called from
C++ (a TVM pass, torch.export's tracer), the exception comes back to Python as another type (TVM turns
`SystemExit(143)` into `RuntimeError: 143`), or a library catches it and goes on, and the compile would commit its
artifact and exit 0. So the request is recorded as well as raised:

- `request(signum)` (the handler's body) records it and raises SystemExit(128 + signum), unless a commit is running
  (`deferred()`), where it only records;
- `deferred()` wraps a commit: it refuses to start once a request is recorded, and raises the recorded request when
  the commit is done, so a request stops a commit before its first rename or takes effect after its last;
- `requested()` tells the command line, whatever exception reached it, to exit 128 + signum.

The state is process-wide, as the signal is.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

_requested: int | None = None
_deferring = 0


def request(signum: int) -> None:
    """Record a termination request (a signal number) and raise SystemExit(128 + signum), the shell's status for
    a process ended by that signal; inside `deferred()` only record it."""
    global _requested
    _requested = signum
    if not _deferring:
        raise SystemExit(128 + signum)


def requested() -> int | None:
    """The signal number of the recorded request, or None."""
    return _requested


def check() -> None:
    """Raise SystemExit(128 + signum) if a request is recorded (one a library swallowed)."""
    if _requested is not None:
        raise SystemExit(128 + _requested)


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block with requests recorded but not raised; raise a request recorded before or during it (before
    the block starts, or after it ends). Nests."""
    global _deferring
    check()
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    check()
