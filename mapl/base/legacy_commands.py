"""The old spellings of the commands, ``python -m mapl.<name>``, kept working for one release.

The commands are ``mapl <command>`` (the ``mapl.cli`` package); the modules the old spelling named are
gone. :func:`install` (called by ``mapl/__init__.py``) appends an import finder that answers for exactly
those module names, and only when nothing else provides them: under ``python -m`` (``runpy``) the module
runs ``mapl.cli.run_deprecated``, which prints one line on stderr naming the new command and runs it with
the same arguments, so exit codes and errors are the new command's. A plain ``import mapl.train`` fails
with an ImportError naming the new module instead of running a command.

Why here: ``import mapl`` is the only code ``runpy`` executes before it looks for ``mapl.train``, so the
finder has to be installed by the package's ``__init__``, the bottom layer; it names the commands as
strings (what runs is generated source importing ``mapl.cli``), so no import points up a layer.
Delete this module and its call in ``mapl/__init__.py`` when the old spelling goes.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__all__ = ["LEGACY_COMMANDS", "LegacyCommandFinder", "install"]

# old module -> the `mapl` command it became; `python -m mapl.data` ran the package's __main__
LEGACY_COMMANDS: dict[str, str] = {
    "mapl.train": "train",
    "mapl.pipeline": "pipeline",
    "mapl.sweep": "sweep",
    "mapl.frozen_trunk": "frozen-trunk",
    "mapl.workspace": "workspace",
    "mapl.reuse": "reuse",
    "mapl.planner": "plan",
    "mapl.costmodel": "costmodel",
    "mapl.peer": "peer",
    "mapl.memory": "memory",
    "mapl.data.__main__": "data",
}

_SOURCE = '''\
import sys
if __name__ != "__main__":
    raise ImportError("{module} is now the command `mapl {command}` (module mapl.cli); only "
                      "`python -m {spelled}` still works, for one release")
from mapl.cli import run_deprecated
sys.exit(run_deprecated({spelled!r}, {command!r}))
'''


class _LegacyCommandLoader(importlib.abc.InspectLoader):
    """Source for one old command module (``InspectLoader`` compiles it for ``runpy`` and for imports)."""

    def __init__(self, module: str, command: str):
        self.module, self.command = module, command

    def get_source(self, fullname: str) -> str:
        spelled = self.module.removesuffix(".__main__")
        return _SOURCE.format(module=self.module, command=self.command, spelled=spelled)

    def is_package(self, fullname: str) -> bool:
        return False


class LegacyCommandFinder(importlib.abc.MetaPathFinder):
    """Finds the old command modules (appended last on ``sys.meta_path``: a real module always wins)."""

    def find_spec(self, fullname, path=None, target=None):
        command = LEGACY_COMMANDS.get(fullname)
        if command is None:
            return None
        # runpy sets sys.argv[0] to the origin: point it at the package that now runs the command
        origin = str(Path(__file__).resolve().parents[1] / "cli" / "__init__.py")
        return importlib.util.spec_from_loader(fullname, _LegacyCommandLoader(fullname, command), origin=origin)


def install() -> None:
    """Append the finder once (a second ``import mapl`` of the same interpreter adds nothing)."""
    if not any(type(f).__name__ == LegacyCommandFinder.__name__ for f in sys.meta_path):
        sys.meta_path.append(LegacyCommandFinder())
