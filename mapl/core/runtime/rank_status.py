"""How a rank tells its launcher why it ended (``$MAPL_STATUS_DIR/rank<r>.json``): accelerate and torchrun replace
a rank's exit code with their own. Both sides live here because the writer, a rank, may not import orchestration."""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["write_status", "read_statuses"]


def write_status(rank: int, status: str, code: int, message: str = "") -> None:
    """Each rank as it exits (a no-op without ``MAPL_STATUS_DIR``)."""
    folder = os.environ.get("MAPL_STATUS_DIR")
    if folder:
        path = Path(folder) / f"rank{rank}.json"
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"status": status, "code": code, "message": message}))
        os.replace(tmp, path)


def read_statuses(folder: Path) -> dict[int, dict]:
    """rank -> {"status", "code", "message"} for every rank that wrote one."""
    out = {}
    for f in Path(folder).glob("rank*.json"):
        try:
            out[int(f.stem[4:])] = json.loads(f.read_text())
        except (ValueError, OSError):
            continue
    return out
