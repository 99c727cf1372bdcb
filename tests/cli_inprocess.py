"""`k3c` run in the test's own process, as `main()` would run it from a shell: no interpreter start-up (about 3 s
a call on a 2-core CPU)."""

from __future__ import annotations

import contextlib
import io
import sys
from unittest import mock


def cli(*args) -> tuple[int, str]:
    """Run `k3c ARGS` (each argument str()-ed) in this process: (exit status, what it wrote on stderr). An exception
    other than SystemExit escapes, as it would end the command with a traceback."""
    from k3c.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            mock.patch.object(sys, "argv", ["k3c", *map(str, args)]):
        try:
            main()
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()
