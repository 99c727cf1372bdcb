"""Termination requests (SIGTERM, SIGHUP, Ctrl-C) that foreign code cannot lose, and commits they cannot tear.

A Python signal handler raises in whichever frame is running. When that frame is a Python callback called from
C++ (a TVM pass, torch.export's tracer), the exception comes back to Python as another type (TVM turns
`SystemExit(143)` into `RuntimeError: 143`), or a library catches it and goes on, and the compile would commit its
artifact and exit 0. And a signal between the two renames that replace an artifact (`--force`) would leave the old
one moved aside and the new one not in. So:

- `request(signum)`, the command line's handler, records the request and raises SystemExit(128 + signum);
  `interrupt(signum)`, its Ctrl-C handler, records it and raises KeyboardInterrupt; `quiet_unraisable` keeps one
  raised inside a finalizer (where Python prints and drops it) off the terminal;
- `requested()` tells the command line, whatever exception reached it, to exit 128 + signum;
- `deferred()` wraps a commit (renames into place): it refuses to start once a request is recorded, holds the
  signals that end a process (`HELD`) while it runs, and delivers a held one to the handler the process had when
  it is done. A signal
  thus stops a commit before its first rename or acts after its last.

The state is process-wide, as signals are.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

_requested: int | None = None
#: what a commit holds: Ctrl-C, `kill` / `timeout` / schedulers, a closed terminal or ssh session, Ctrl-\\
HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def request(signum: int) -> None:
    """Record a termination request (a signal number) and raise SystemExit(128 + signum), the shell's status for
    a process ended by that signal."""
    global _requested
    _requested = signum
    raise SystemExit(128 + signum)


def interrupt(signum: int, frame=None) -> None:
    """Ctrl-C's handler (`signal.signal`'s arguments): record the request as `request` does and raise
    KeyboardInterrupt, as Python's own handler does (click turns it into its Abort), so that one a library
    swallows still stops the command and its commit."""
    global _requested
    _requested = signum
    raise KeyboardInterrupt


def quiet_unraisable(unraisable) -> None:
    """`sys.unraisablehook` while a command runs: a termination request raised where Python cannot raise (a
    finalizer, a weakref callback: "Exception ignored in ...") is not printed, since it is recorded and acts at
    the next commit or at exit; anything else goes to Python's own hook."""
    if _requested is not None and isinstance(unraisable.exc_value, (SystemExit, KeyboardInterrupt)):
        return
    sys.__unraisablehook__(unraisable)


def requested() -> int | None:
    """The signal number of the recorded request, or None."""
    return _requested


def check() -> None:
    """Raise SystemExit(128 + signum) if a request is recorded (one a library swallowed)."""
    if _requested is not None:
        raise SystemExit(128 + _requested)


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block with the `HELD` signals held (in the main thread, where Python runs handlers; elsewhere a
    signal cannot interrupt the block); then deliver the first one held to the handler in place before. Raises
    SystemExit at entry if a request is recorded (`check`), before the block starts."""
    check()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in HELD}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if held:
            signal.raise_signal(held[0])
