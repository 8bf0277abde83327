"""`mapl docs`: write every generated block of the documents from its source; `--check` fails on a difference."""
from __future__ import annotations

import sys
from pathlib import Path

from ..base.cli import run_cli
from ..base.io import atomic_write_text
from ..core.config import PROJECT_ROOT, load_params
from ..report.docblocks import RENDERERS, BlockError, blocks_in, replace_block
from . import command_parser

__all__ = ["DOCUMENTS", "PROG", "estimate_block", "render", "main"]

PROG = "mapl docs"

# the documents that hold generated blocks (a block's name decides its renderer)
DOCUMENTS = ("README.md", "docs/reproducing.md", "notebooks/README.md", "benchmarks/README.md")


def estimate_block(root: Path) -> str:
    """`mapl sweep --estimate` of the default profile as a fresh clone prints it (a code block)."""
    from ..orchestration import progress, sweep
    params = load_params(root / "params.yaml")
    with progress.committed_data_only():
        text = sweep.estimate_text(params["profile"], params)
    return "```\n" + text.rstrip() + "\n```"


def _renderer(name: str):
    if name == "estimate":
        return estimate_block
    if name not in RENDERERS:
        raise BlockError(f"unknown generated block {name!r}: allowed {', '.join([*RENDERERS, 'estimate'])}")
    return RENDERERS[name]


def render(text: str, root: Path) -> str:
    """`text` with every generated block rewritten from its source."""
    for name in blocks_in(text):
        text = replace_block(text, name, _renderer(name)(root))
    return text


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv) -> int:
    ap = command_parser("docs", "Write the documents' generated blocks from their sources.", """
        mapl docs            # rewrite every generated block of README.md and docs/*.md
        mapl docs --check    # compare only: exit 2 naming the documents that differ""")
    ap.add_argument("--check", action="store_true", help="compare only; exit 2 when a block differs")
    args = ap.parse_args(argv)
    root = PROJECT_ROOT
    stale = []
    for rel in DOCUMENTS:
        path = root / rel
        text = path.read_text()
        new = render(text, root)
        if new == text:
            continue
        if args.check:
            stale.append(rel)
        else:
            atomic_write_text(path, new)
            print(f"wrote {rel}")
    if stale:
        raise BlockError(f"{', '.join(stale)}: generated blocks differ from their sources; run `mapl docs`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
