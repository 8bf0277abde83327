"""``mapl notebook``: execute a notebook with papermill, as dvc.yaml's stages do. What the notebook raises for the user
(a refused parameter, missing data, a damaged results file) is one ``error:`` line and exit 2, Ctrl-C is exit 130:
papermill's own command would print its traceback and exit 1 for both."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..base.cli import EXIT_BUG, add_debug_flag, run_cli
from ..base.io import check_writable, owned_temp_folder
from . import command_parser

__all__ = ["main", "PROG", "parameter_value"]

PROG = "mapl notebook"
# the exceptions mapl raises for the user (mapl.base.cli.USER_ERRORS and its ValueErrors), by the name the kernel
# reports: only a name crosses from the kernel
USER_ERROR_NAMES = frozenset({"ValueError", "FileNotFoundError", "PermissionError", "IsADirectoryError",
                              "NotADirectoryError", "ConfigError", "NotebookParameterError", "DataError",
                              "MissingDataError", "OutputError", "ResultsError", "CheckpointError"})


# ipykernel warns on every start that its local TCP transport is unencrypted: a second line around every error
QUIET_KERNEL = ["--IPKernelApp.log_level=ERROR"]


class NotebookError(ValueError):
    """A user error raised inside the notebook, re-raised here as one line."""


def parameter_value(text: str):
    """papermill's ``-p NAME VALUE`` typing: True, False, None, an int, a float, else the string."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = command_parser("notebook", "Execute a notebook with papermill; an error it raises for the user is one line.", """
        mapl notebook notebooks/report.ipynb reports/cpu/notebooks/report.ipynb -p profile cpu
        mapl notebook notebooks/when_it_pays.ipynb out.ipynb -p case paper -p latency_ms 50""")
    ap.add_argument("notebook", type=Path, help="the notebook to execute")
    ap.add_argument("out", type=Path, help="the executed copy (its folder is created)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="a parameter, typed as papermill types it (repeatable)")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if not args.notebook.is_file():
        raise FileNotFoundError(f"notebook {args.notebook} does not exist")
    check_writable(args.out)         # papermill writes the copy in place as cells run: a FIFO would block it
    import papermill                 # lazily: `mapl --help` and the checks above need no Jupyter stack
    with _kernel_runtime(), _kernel_stderr() as replay:
        try:
            papermill.execute_notebook(str(args.notebook), str(args.out), progress_bar=False,
                                       extra_arguments=QUIET_KERNEL,
                                       parameters={name: parameter_value(v) for name, v in args.parameter})
        except KeyboardInterrupt:
            replay[0] = False
            raise KeyboardInterrupt(f"{args.notebook} stopped; rerun the same command") from None
        except papermill.PapermillExecutionError as e:
            if e.ename == "KeyboardInterrupt":
                replay[0] = False
                raise KeyboardInterrupt(f"{args.notebook} stopped in cell {e.exec_count}; rerun the same command") from None
            if e.ename in USER_ERROR_NAMES:
                replay[0] = False
                raise NotebookError(e.evalue) from None
            bug = e
        else:
            return 0
    sys.stderr.write(str(bug) + f"\n{PROG}: {args.notebook} raised {bug.ename} in cell {bug.exec_count}: a bug, please "
                                "report it with the traceback above\n")
    return EXIT_BUG


@contextlib.contextmanager
def _kernel_runtime():
    """The kernel's connection file (nbclient writes it with ``tempfile``) in a folder of this process, removed
    afterwards; a killed run's folder is removed by the next run, and no other program's files are touched."""
    folder, old = owned_temp_folder("mapl-kernel"), tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = old
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _kernel_stderr():
    """The kernel inherits this process's stderr. What reaches it while the notebook runs is held in a temporary file:
    written out after a success or a bug, dropped after a user error or an interrupt (then it is only the kernel's
    log of its own shutdown, a traceback around the one line). Yields a flag: keep it (True) or drop it."""
    sys.stderr.flush()
    saved, replay = os.dup(2), [True]
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield replay
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if replay[0]:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
