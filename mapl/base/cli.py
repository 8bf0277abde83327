"""The one error policy of every ``mapl`` command: exit codes (:data:`EXIT_CODES`) and one-line errors.

A user error prints ONE line ``error: ...`` naming what to fix (``--debug`` or ``MAPL_DEBUG=1`` adds the
traceback); anything unexpected is a bug and prints its traceback. SIGTERM to the entry point's process is a Ctrl-C
too (:func:`run_cli`), so a sweep's pool workers stop after their step with their checkpoints written.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, NoReturn, Sequence

__all__ = ["EXIT_OK", "EXIT_BUG", "EXIT_USER_ERROR", "EXIT_PEER_FAILED", "EXIT_NON_FINITE", "EXIT_STEP_FAILED",
           "EXIT_NOT_CONSISTENT", "EXIT_INTERRUPTED", "EXIT_CODES", "fail", "USER_ERRORS", "PeerFailure", "exit_code",
           "error_line", "report", "run_cli", "add_debug_flag", "debug_requested", "SUPERVISED_ENV"]

EXIT_OK = 0
EXIT_BUG = 1                 # Python's own code for an uncaught exception
EXIT_USER_ERROR = 2          # argparse's code for a usage error: the same family
EXIT_PEER_FAILED = 3
EXIT_NON_FINITE = 4
EXIT_STEP_FAILED = 5         # a supervisor's step failed: neither a bug here nor the user's input as such
EXIT_NOT_CONSISTENT = 6      # a verdict, not a failure: `mapl rerun` ran and its numbers disagree with the committed
EXIT_INTERRUPTED = 130       # the shell's 128 + SIGINT

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_BUG: "a bug (an unexpected exception): the traceback is printed; please report it",
    EXIT_USER_ERROR: "user error (flag, config, input data, checkpoint, output path) or the machine's (a read-only "
                     "folder, a full disk): one line `error: ...` names what to fix",
    EXIT_PEER_FAILED: "a peer process of the multi-process pipeline failed or did not answer in time",
    EXIT_NON_FINITE: "non-finite values (NaN/Inf): the run stopped, the last good checkpoint is kept",
    EXIT_STEP_FAILED: "a run that `mapl sweep` started, or a step that `mapl workspace` ran in its copy, failed (its "
                      "output is printed), or the re-executed report differs from the committed one (each difference "
                      "named)",
    EXIT_NOT_CONSISTENT: "`mapl rerun` trained and judged its runs: not consistent with the committed results by "
                         "docs/protocol.md's rerun rule (each check outside its interval is named)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C / SIGTERM): stopped after the step in flight, checkpoint written",
}

# By contract a ValueError (ConfigError, DataError, OutputError) is phrased for the user; the OSErrors name a user's path.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# The machine's OS errors (read-only filesystem, full disk, quota, file-size limit): the user's to fix, with a hint.
ENVIRONMENT_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class PeerFailure(RuntimeError):
    """Another process of a multi-process run died or did not answer (exit code 3); the message names the peer."""


def exit_code(exc: BaseException) -> int:
    """The documented exit code for an exception that ended a run."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, PeerFailure):
        return EXIT_PEER_FAILED
    if isinstance(exc, FloatingPointError):
        return EXIT_NON_FINITE
    if isinstance(exc, USER_ERRORS) or isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
        return EXIT_USER_ERROR
    return EXIT_BUG


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        from .io import os_error_hint            # lazily: io is not needed to report most errors
        hint = os_error_hint(exc.filename, exc.errno) if exc.errno != errno.ENOENT else None
        text = f"{exc.filename}: {exc.strerror}" + (f" ({hint})" if hint else "")   # not "[Errno 2] No such ...: 'x'"
    else:
        text = str(exc)
    # one line whatever the raiser wrote: a message with newlines would look like several errors
    return re.sub(r"\s*\n\s*", " ", text.strip()) or type(exc).__name__


# Set by a supervisor for the commands it starts (mapl workspace, for DVC and everything below it): when it stops
# them it says so itself, once, so their own "interrupted" lines would only repeat it.
SUPERVISED_ENV = "MAPL_SUPERVISED"


def error_line(exc: BaseException, label: str | None = None) -> str:
    """The one line printed for ``exc``: ``error: [label: ]message`` or ``interrupted: ...``."""
    if isinstance(exc, KeyboardInterrupt):       # a bare Ctrl-C has no message
        parts = ["interrupted", label, _message(exc) if str(exc).strip() else None]
    else:
        parts = ["error", label, _message(exc)]
    return ": ".join(p for p in parts if p)


def _line(text: str) -> None:
    """One ``write`` for text and newline: the pipeline's ranks share one stderr, and ``print``'s two writes could
    interleave with another rank's line."""
    sys.stderr.write(text + "\n")


def report(exc: BaseException, *, prog: str = "mapl", label: str | None = None, debug: bool = False) -> int:
    """Print what ``exc`` means for the user to stderr and return its exit code (for entry points that must leave
    with ``os._exit``; everyone else uses ``run_cli``)."""
    code = exit_code(exc)
    sys.stdout.flush()
    if code == EXIT_BUG:
        traceback.print_exception(exc)
        _line(f"{prog}: unexpected {type(exc).__name__}{' on ' + label if label else ''}: this is a bug, "
              f"please report it with the traceback above")
    elif not (code == EXIT_INTERRUPTED and os.environ.get(SUPERVISED_ENV) == "1"):
        if debug:
            traceback.print_exception(exc)
        _line(error_line(exc, label))
    sys.stderr.flush()
    return code


def fail(message: str, code: int = EXIT_USER_ERROR) -> NoReturn:
    """Leave a script with one line on stderr and a documented exit code (``SystemExit("text")`` would exit 1, a bug's)."""
    sys.stdout.flush()
    _line(message)
    raise SystemExit(code)


def debug_requested(argv: Sequence[str]) -> bool:
    """``--debug`` among the arguments (before a ``--``) or ``MAPL_DEBUG`` set to anything but 0/empty."""
    flags = list(argv)[:list(argv).index("--")] if "--" in argv else list(argv)
    return "--debug" in flags or os.environ.get("MAPL_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None, *, prog: str,
            label: str | None = None) -> int:
    """Call ``main(argv)`` (without ``--debug``) and return its code (``None`` is 0), or ``report``'s for an exception;
    ``SystemExit`` (argparse's usage errors, ``--help``) passes through."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    if "--debug" in argv:
        cut = argv.index("--") if "--" in argv else len(argv)
        argv = [a for a in argv[:cut] if a != "--debug"] + argv[cut:]
    try:
        with _sigterm_interrupts():
            code = main(argv)
            sys.stdout.flush()              # a closed pipe shows here, where it is handled, not at interpreter exit
    except BrokenPipeError:
        # the reader of our stdout left (`mapl sweep --estimate | head -1`): nothing to tell; stdout goes to /dev/null
        # so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (Exception, KeyboardInterrupt) as e:     # noqa: BLE001 -- the policy itself: each gets its code
        return report(e, prog=prog, label=label, debug=debug)
    return EXIT_OK if code is None else int(code)


@contextmanager
def _sigterm_interrupts():
    """SIGTERM raises ``KeyboardInterrupt`` while the block runs (outside the main thread no handler can be set)."""
    try:
        old = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def add_debug_flag(parser):
    """Document ``--debug`` in a command's ``--help`` (``run_cli`` consumes the flag itself); returns the parser."""
    parser.add_argument("--debug", action="store_true", help="tracebacks for user errors too (or MAPL_DEBUG=1)")
    return parser
