"""What every `k3c` command shares: the Typer app the commands register on, the stdout/stderr consoles, progress
bars and the garbage-collector switch of long compiler commands. Imports only typer and rich (start-up stays
short: torch and the compiler are imported inside the commands)."""

from __future__ import annotations

import gc
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from k3c import __version__
from k3c.atomic import name_too_long
from k3c.errors import K3CError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="k3c: ahead-of-time compiler for the Kimi K3 family")
err = Console(stderr=True)
# piped or redirected, stdout has no width to fit: rich would cut tables (the `k3c plan` headers) to 80 columns
out = Console(width=None if os.isatty(1) or "COLUMNS" in os.environ else 160)


@contextmanager
def progress_bars():
    """A `progress(step, done, total)` callback drawing one transient bar per step name on stderr (nothing when
    stderr is not a terminal). `total` None: a spinner-like bar without a count."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def update(step: str, done: int, total: int | None) -> None:
            if step not in tasks:
                tasks[step] = bar.add_task(step, total=total)
            bar.update(tasks[step], completed=done, total=total)

        yield update


def compiling() -> None:
    """Before a long compiler command: CPython's cyclic GC off until the command returns (`k3c.cli.main` turns it
    back on; the IR and the FX graphs are millions of small objects that live until the end, and each full
    collection would walk them again)."""
    gc.disable()


def check_writable(path: Path, flag: str, file: bool = False) -> None:
    """Raise K3CError (naming `flag` and `path`) unless `path` can be created: its parent is a directory that accepts
    a new entry, its name is no longer than that directory's file system allows (`k3c.atomic.name_too_long`), and,
    with `file`, path is not a directory (an output file's name). Probed with a temporary file, since permission
    bits tell neither root's rights nor a read-only or virtual file system; called before the work, so a bad output
    location fails in a second, not after it."""
    if str(path) in ("", "."):    # Path("") is ".": an empty -o would name the current directory
        raise K3CError(f"{flag} is empty or '.': give a path to a new " + ("file" if file else "directory"))
    too_long = name_too_long(path)  # first: stat of such a name fails too
    if too_long:
        raise K3CError(f"{flag} {path}: {too_long}")
    if file and path.is_dir():
        raise K3CError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist (k3c creates no parent directories)"
        raise K3CError(f"{flag} {path}: {parent} {why}")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".k3c-probe-")
    except OSError as e:
        raise K3CError(f"{flag} {path}: cannot create files in {parent} ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def check_dump_dir(dump: Path | None) -> None:
    """Raise K3CError unless `--dump` directory `dump` (None: no dump) is new or empty and can be created: the IR
    dumps write prefill/ and decode/ files into it, and must not replace files a user keeps there."""
    if dump is None:
        return
    if dump.exists() and (not dump.is_dir() or any(dump.iterdir())):
        raise K3CError(f"--dump {dump}: exists and is not an empty directory; choose a new one")
    if not dump.exists():
        check_writable(dump, "--dump")


def check_artifact_exists(artifact: Path) -> None:
    """Raise K3CError unless `artifact` exists (before the runtime, and torch, are imported to read it)."""
    if not artifact.exists():
        raise K3CError(f"{artifact}: no such artifact (expected a directory or a .k3c file)")


def _version(value: bool) -> None:
    if value:
        out.print(f"k3c {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print the version and exit")) -> None:
    """k3c: ahead-of-time compiler for the Kimi K3 family."""
