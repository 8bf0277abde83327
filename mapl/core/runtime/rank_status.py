"""How a rank tells whoever started it why it ended: ``$MAPL_STATUS_DIR/rank<r>.json``.

A launcher sees only exit codes, and accelerate or torchrun replace a rank's code with their own (1 and a
ChildFailedError): each rank writes its status (``done``, ``error`` or ``interrupted``, the exit code and
its one-line message) as it exits, and the launcher (``mapl.orchestration.launch``) reads them all. Both
sides are here, in the runtime, because the writer is a rank process (``rank_process``), which may not
import the orchestration layer above it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["write_status", "read_statuses"]


def write_status(rank: int, status: str, code: int, message: str = "") -> None:
    """Called by each rank as it exits (no-op without ``MAPL_STATUS_DIR``)."""
    folder = os.environ.get("MAPL_STATUS_DIR")
    if folder:
        path = Path(folder) / f"rank{rank}.json"
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"status": status, "code": code, "message": message}))
        os.replace(tmp, path)


def read_statuses(folder: Path) -> dict[int, dict]:
    """rank -> {"status", "code", "message"} of every rank that wrote one into ``folder``."""
    out = {}
    for f in Path(folder).glob("rank*.json"):
        try:
            out[int(f.stem[4:])] = json.loads(f.read_text())
        except (ValueError, OSError):
            continue
    return out
