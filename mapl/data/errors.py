"""The one exception type of ``mapl.data``: one line naming the file (or field), what is wrong and the fix."""
from __future__ import annotations

__all__ = ["DataError", "MissingDataError", "prepare_command"]


class DataError(ValueError):
    """Data that cannot be used as it is: missing, corrupt, truncated or prepared for another config."""


class MissingDataError(DataError, FileNotFoundError):
    """A prepared folder, manifest or shard is absent (also a ``FileNotFoundError``)."""


def prepare_command(profile: str | None = None, rebuild: bool = False) -> str:
    """The command that (re)creates a profile's data, quoted for error messages."""
    cmd = f"mapl data --profile {profile or '<profile>'}" + (" --rebuild" if rebuild else "")
    return f"`{cmd}`" if rebuild else f"`{cmd}` (or `dvc repro prepare`)"
