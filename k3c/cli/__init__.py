"""The `k3c` command line. Every error k3c raises on purpose (`K3CError`) is printed here as one line, exit 2.

    k3c init PRESET -o DIR [--seed 0] [--dtype f32|bf16]      a random checkpoint in the published layout
    k3c compile MODEL -o ART [--report FILE.html] ...         an artifact (and its HTML report)
    k3c run ART [--tokens 1,2,3] [--decode-steps 8]           prefill + greedy decode
    k3c report ART -o report.html                             the compile report of an artifact
    k3c inspect MODEL [--entry prefill|decode] [--after PASS] [--format text|json|dot|svg|onnx|summary]
                      [--layer N | --collapse] [-o FILE]
    k3c check MODEL [--entry ...] [--batch 2] [--tokens 7]     interpret before/after every pass on random weights
    k3c plan MODEL [--tp 1,2,4,8]                             memory per GPU and a decode roofline

One module per job: `app` (the Typer app, consoles, progress bars), `ir` (inspect, check), `build` (init,
compile, report), `run` (run, finalize: on the machine that runs an artifact), `plan`. Start-up is kept short
(`k3c --help` and argument errors well under a second): torch and the compiler are imported inside the commands
that need them, after the arguments are checked. Progress bars go to stderr and only when it is a terminal.

MODEL is a preset name (k3-tiny, k3.1-pro-tiny, kimi-linear-tiny, k3, k3.1-pro, kimi-linear-48b), a config.json, or a
checkpoint directory. Without weights the model is built on the meta device (no memory), which is how full-size
configurations are inspected.
"""

from __future__ import annotations

import gc
import signal
import sys

import typer

from k3c.cli import ir, build, run, plan  # noqa: F401, I001  (registers the commands; --help lists them in this order)
from k3c import termination
from k3c.cli.app import app, err
from k3c.errors import K3CError


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM (what `timeout`, `kill` and schedulers send) and SIGHUP (a closed terminal or ssh session) unwind the
    command as Ctrl-C does, so the staging directory of an unfinished artifact or checkpoint is removed; exit
    status 128 + signum, the shell's (143, 129). The request is also recorded (`k3c.termination`), so that foreign
    code that turns the exception into another one, or swallows it, cannot make the command commit or exit
    otherwise."""
    termination.request(signum)


def main() -> None:
    """Entry point: run the app, printing a usage error (unknown option, bad value), a K3CError and an OSError on a
    path the user gave as one line each, exit 2. SIGTERM and SIGHUP end the command cleanly, exit 143 or 129
    (`_exit_on_sigterm`), and Ctrl-C with 130 (`termination.interrupt`), whatever the exception became on its way
    out, even one a library swallowed (no commit starts after it); one ignored (`nohup`, a background job) stays
    ignored."""
    gc_was_on = gc.isenabled()
    before = {s: signal.signal(s, _exit_on_sigterm) for s in (signal.SIGTERM, signal.SIGHUP)
              if signal.getsignal(s) is not signal.SIG_IGN}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:     # not where Ctrl-C is ignored (a job)
        before[signal.SIGINT] = signal.signal(signal.SIGINT, termination.interrupt)
    hook, sys.unraisablehook = sys.unraisablehook, termination.quiet_unraisable
    try:
        _run_app()
        termination.check()
    except BaseException:
        signum = termination.requested()
        if signum is None:
            raise
        sys.exit(128 + signum)
    finally:
        sys.unraisablehook = hook
        for s, handler in before.items():
            signal.signal(s, handler)
        if gc_was_on:  # a command may pause it (`app.compiling`); a caller running main() in process gets it back
            gc.enable()


def _run_app() -> None:
    try:
        code = app(standalone_mode=False)  # click's errors come here instead of its boxed usage text
        if isinstance(code, int) and code:  # typer.Exit(code) of a command
            sys.exit(code)
    except typer.TyperException as e:  # click's errors (typer's base class of them)
        if type(e).__name__ != "NoArgsIsHelpError":  # (`k3c` alone: typer printed the help already)
            ctx = getattr(e, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            err.print(f"[red]error:[/] {e.format_message()}{hint}", highlight=False, soft_wrap=True)
        sys.exit(getattr(e, "exit_code", 2))
    except typer.Abort:  # Ctrl-C, end of input
        err.print("aborted")
        sys.exit(1)
    except K3CError as e:
        err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except OSError as e:  # a path the user named (-o, --dump) that cannot be written or read
        where = f"{e.filename}: " if e.filename else ""
        err.print(f"[red]error:[/] {where}{e.strerror or e}", highlight=False, soft_wrap=True)
        sys.exit(2)
