"""The report notebook's glue: where a profile's outputs go, and showing a table or figure (written
to disk, then displayed as Markdown and PNG with its caption and takeaway).

    >>> paths = output_paths(ROOT, "cpu")          # reports/cpu/{results,tables,figures,metrics.json}
    >>> show(table1(rows), paths["tables"])
"""
from __future__ import annotations

from pathlib import Path

from .figures import png_bytes
from .plots import Plot
from .rows import results_dir
from .table import Table, write_table

__all__ = ["output_paths", "show"]


def output_paths(root: str | Path, profile: str, results: str | Path = "", out: str | Path = "") -> dict[str, Path]:
    """``results`` (default ``reports/<profile>/results``), ``tables``, ``figures`` and ``metrics``
    under ``out`` (default ``reports/<profile>``); relative paths are taken from ``root``."""
    root = Path(root)
    base = root / (out or Path("reports") / profile)
    return {"results": root / (results or results_dir(profile)), "tables": base / "tables",
            "figures": base / "figures", "metrics": base / "metrics.json"}


def show(item: Table | Plot, folder: str | Path) -> None:
    """Write ``item`` into ``folder`` (a table as .md/.csv/.tex, a figure as .png), then display it:
    a table as Markdown with its caption and takeaway; a figure as the image, its caption and
    takeaway. Without data, only one line saying so is displayed (the files are written anyway)."""
    from IPython.display import Image, Markdown, display
    if isinstance(item, Table):
        write_table(item, folder)
        display(Markdown(item.render()))
        return
    item.save(folder)
    if item.empty:
        display(Markdown(f"**Figure {item.name}:** {item.takeaway}"))
        return
    display(Image(data=png_bytes(item.figure)))
    display(Markdown(f"*Figure {item.name}.* {item.caption}\n\n*Takeaway:* {item.takeaway}"))
