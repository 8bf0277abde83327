"""The docs' generated blocks (<!-- generated:NAME -->), rendered from committed files; `mapl docs --check` fails on drift."""
from __future__ import annotations

import ast
import csv
import json
import re
from pathlib import Path
from typing import Callable

import yaml

from .render import to_markdown


__all__ = ["BlockError", "blocks_in", "replace_block", "short_ours", "claims_block", "headline_block",
           "notebook_parameters", "stages_block",
           "benchmarks_block", "RENDERERS"]

_MARK = "<!-- generated:{0} -->", "<!-- /generated:{0} -->"
_BLOCK = re.compile(r"<!-- generated:([\w-]+) -->")


class BlockError(ValueError):
    """A malformed generated block or a missing source, in one line naming both."""


def blocks_in(text: str) -> list[str]:
    """The names of the generated blocks of ``text``, in order."""
    return _BLOCK.findall(text)


def replace_block(text: str, name: str, content: str) -> str:
    """``text`` with block ``name``'s body replaced by ``content`` (the markers kept)."""
    start, end = (m.format(name) for m in _MARK)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise BlockError(f"block {name!r}: expected one {start} followed by one {end}")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{content.rstrip()}\n{end}{tail}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    return to_markdown(header, [[c.replace("\n", " ").strip() for c in row] for row in rows]).rstrip("\n")


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise BlockError(f"{path}: missing (run `dvc repro` to write it)")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


_BUDGET = re.compile(r"\((?:[\d.]+%, )?(n = \d+)[^)]*\)")


def short_ours(cell: str) -> str:
    """A ledger cell as the README prints it: estimate, interval and seeds (``claims.md`` has the level and the rest)."""
    return _BUDGET.sub(r"(\1)", cell)


def claims_block(root: Path, profile: str = "cpu") -> str:
    """The claims ledger, one line per claim: the claim, ours (short), the verdict on validation and on held-out
    text; the tally under it, and the one rule for the intervals' levels."""
    rows = _read_csv(root / "reports" / profile / "tables" / "claims.csv")
    held = [k for k in (rows[0] if rows else {}) if k.startswith("verdict on ")]
    # the paper's cell (its source) stays in claims.md: each claim's text carries the size it claims
    header = ["the paper's claim", "ours (table; familywise 95 % interval)", "verdict (validation)",
              *[k.replace("verdict on ", "on ") for k in held]]
    body = [[r["paper's claim"], short_ours(r["ours (table)"]), f"**{r['verdict']}**", *[r[k] for k in held]]
            for r in rows]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("reproduced", "contradicted", "inconclusive",
                                                                "not testable here")}
    tally = ", ".join(f"{n} {v}" for v, n in counts.items())
    return (f"{_table(header, body)}\n\n**{len(rows)} claims: {tally}** (on the validation split). Each interval "
            "is read so that the rows testing one paper claim err with probability at most 5 % together (the "
            f"levels per row and the rule: `reports/{profile}/tables/claims.md`).")


def headline_block(root: Path, profile: str = "cpu") -> str:
    """The headline table's rows, the columns a reader compares (headline.md has them all)."""
    rows = _read_csv(root / "reports" / profile / "tables" / "headline.csv")
    keep = ["method", "wire ratio", "total B/tok", "val loss", "Δ%", "Δ% 95% CI", "paper Δ%"]
    body = _table(keep, [[r[k] for k in keep] for r in rows])
    seeds = sorted({r["seeds"] for r in rows})
    on = f"seeds {seeds[0]}" if len(seeds) == 1 else "seeds per row in the table"
    return (f"Headline (`reports/{profile}/tables/headline.md`, {on}; Δ% ± sd over seeds and its 95 % "
            f"interval):\n\n{body}")


def notebook_parameters(notebook: Path) -> list[str]:
    """The names its ``parameters``-tagged cell assigns (what papermill's ``-p`` may set)."""
    for cell in json.loads(notebook.read_text())["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            return [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)]
    return []


def stages_block(root: Path) -> str:
    """The DVC stages: the notebook each executes with its parameters, what it does, what it writes."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    rows = []
    for name, stage in stages.items():
        body = stage.get("do", stage)
        label = f"`{name}@<group>`" if "foreach" in stage else f"`{name}`"
        cmd = " ".join(body["cmd"]) if isinstance(body["cmd"], list) else body["cmd"]
        found = re.search(r"mapl notebook (notebooks/[\w.]+\.ipynb)", cmd)
        notebook = ""
        if found:
            names = ", ".join(f"`{p}`" for p in notebook_parameters(root / found.group(1)))
            notebook = f"`{found.group(1)}` ({names})"
        outs = [next(iter(o)) if isinstance(o, dict) else o
                for key in ("outs", "plots", "metrics") for o in body.get(key, [])]
        rows.append([label, notebook, " ".join(body.get("desc", "").split()), ", ".join(f"`{o}`" for o in outs)])
    return _table(["stage", "notebook (parameters)", "what it does", "writes"], rows)


def _script_doc(path: Path) -> list[str]:
    """A benchmark's documentation: a Python script's docstring, a shell script's leading comments."""
    if path.suffix == ".py":
        return (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()
    lines = path.read_text().splitlines()[1:]                         # past the shebang
    head = [ln for ln in lines[:next((i for i, ln in enumerate(lines) if not ln.startswith("#")), len(lines))]]
    return [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in head]


def _benchmark_row(path: Path) -> list[str] | None:
    """(script, what it answers, command, writes); a script without a ``Writes:`` line is a helper (None)."""
    doc = _script_doc(path)
    writes = next((ln.strip()[len("Writes:"):].strip().rstrip(".") for ln in doc if ln.strip().startswith("Writes:")), "")
    if not writes:
        return None
    runs_itself = re.compile(rf"^\s*(?:nice\s+)?(?:python|bash) benchmarks/{re.escape(path.name)}\b")
    usage = next((ln.split("#")[0].strip() for ln in doc if runs_itself.match(ln)), None)
    summary = next((ln.strip() for ln in doc if ln.strip()), "")
    if usage is None or summary.startswith("Writes:"):
        raise BlockError(f"{path}: a benchmark's documentation needs a first line (what it answers) and a usage line "
                         f"`python benchmarks/{path.name} ...`")
    return [f"`{path.name}`", summary.replace("``", "`"), f"`{usage.replace('nice ', '')}`", writes.replace("``", "`")]


def benchmarks_block(root: Path) -> str:
    """Every benchmark script: what it answers, how it runs and what it writes."""
    paths = sorted([*(root / "benchmarks").glob("*.py"), *(root / "benchmarks").glob("*.sh")])
    rows = [row for row in map(_benchmark_row, paths) if row]
    return _table(["script", "what it answers", "command", "writes"], rows)


RENDERERS: dict[str, Callable[[Path], str]] = {
    "claims": claims_block,
    "headline": headline_block,
    "stages": stages_block,
    "benchmarks": benchmarks_block,
}
