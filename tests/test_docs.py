"""The documents: the README stays a five-minute page, every number of a sentence that names a table is printed
by that table, generated blocks equal their sources, and the documents speak of the software, not of its making."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.prose import check_document, numbers, sentences

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_LIMIT_BYTES = 15 * 1024

# development history ("round N", "issue N", "in round N we") belongs in CHANGELOG.md, nowhere a reader learns the tool
HISTORY = re.compile(r"\b(rounds?|issues?)\s+\d+", re.I)


def narrative_files() -> list[Path]:
    return [ROOT / "README.md", *DOCS, ROOT / "notebooks" / "README.md", ROOT / "benchmarks" / "README.md"]


def markdown_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def test_readme_is_a_five_minute_page():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size:,} bytes; move detail to docs/ (limit {README_LIMIT_BYTES:,})"


def test_readme_sections_come_in_the_readers_order():
    heads = [ln[3:].strip() for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("## ")]
    order = ["Two commands", "Results at a glance", "Reading the executed notebooks", "Running one experiment",
             "The paper's grid on GPUs", "Where is what", "Choices where the paper is silent", "Citing and licence"]
    assert [h for h in heads if h in order] == order, heads


@pytest.mark.parametrize("path", narrative_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_carry_no_development_history(path):
    hits = [ln for ln in path.read_text().splitlines() if HISTORY.search(ln)]
    assert not hits, f"{path.name}: history belongs in CHANGELOG.md: {hits[:3]}"


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_narrative_carries_no_development_history(notebook):
    hits = [c for c in markdown_cells(notebook) if HISTORY.search(c)]
    assert not hits, f"{notebook.name}: {hits[0][:120]}"


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_of_a_sentence_naming_a_table_is_in_that_table(path):
    strict = path.name == "results.md"
    findings = check_document(path, ROOT, strict=strict)
    assert not findings, "\n".join(map(str, findings))


# ---- the checker itself: it must be able to fail ----------------------------------------------------------


def test_numbers_are_normalised_as_printed():
    assert numbers("+1.59 [−0.21, +2.15] at 3,000 steps, seeds 0-7, bf16, P=4") == \
        {"1.59", "-0.21", "2.15", "3000", "0", "7", "4"}


def test_sentences_split_paragraphs_rows_and_items_but_not_abbreviations():
    text = "First (App. C, 150M) ends here. Second one.\n\n| a | 1 |\n* item 2\n"
    assert [s for _, s in sentences(text)] == ["First (App. C, 150M) ends here.", "Second one.", "| a | 1 |", "* item 2"]


def test_a_number_the_named_table_does_not_print_is_found(tmp_path):
    (tmp_path / "reports" / "cpu" / "tables").mkdir(parents=True)
    (tmp_path / "reports" / "cpu" / "tables" / "t.md").write_text("| x |\n|---|\n| +1.59 [+1.03, +2.15] |\n")
    doc = tmp_path / "doc.md"
    doc.write_text("The gap is +1.59 [+1.03, +2.15] (`t.md`). It is 1.60 in `t.md`. Elsewhere 9.99.\n")
    found = check_document(doc, tmp_path)
    assert [f.problem for f in found] == ["1.60 not in t.md"]
    strict = check_document(doc, tmp_path, strict=True)
    assert [f.problem for f in strict][-1] == "states a measured number but names no table"


def test_a_generated_block_is_not_prose(tmp_path):
    (tmp_path / "reports" / "cpu" / "tables").mkdir(parents=True)
    (tmp_path / "reports" / "cpu" / "tables" / "t.md").write_text("1.0\n")
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- generated:x -->\n| 7.5 (t.md) |\n<!-- /generated:x -->\n")
    assert check_document(doc, tmp_path) == []


# ---- generated blocks ------------------------------------------------------------------------------------------


def test_every_generated_block_equals_its_source():
    from mapl.cli import docs
    assert docs.main(["--check"]) == 0, "a generated block differs from its source: run `mapl docs`"


def test_a_stale_block_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from mapl.cli import docs
    for rel in docs.DOCUMENTS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("no blocks here\n")
    tables = tmp_path / "reports" / "cpu" / "tables"
    tables.mkdir(parents=True)
    (tables / "claims.csv").write_text((ROOT / "reports/cpu/tables/claims.csv").read_text())
    stale = "<!-- generated:claims -->\n| a hand-edited ledger |\n<!-- /generated:claims -->\n"
    (tmp_path / "README.md").write_text(stale)
    monkeypatch.setattr(docs, "PROJECT_ROOT", tmp_path)
    assert docs.main(["--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "README.md" in err[0] and "mapl docs" in err[0]
    assert (tmp_path / "README.md").read_text() == stale           # --check writes nothing
    assert docs.main([]) == 0 and "hand-edited" not in (tmp_path / "README.md").read_text()


def test_the_claims_block_is_the_ledger_row_by_row():
    import csv
    from mapl.report.docblocks import claims_block
    rows = list(csv.DictReader((ROOT / "reports/cpu/tables/claims.csv").open()))
    table, tally = claims_block(ROOT).split("\n\n")
    block = table.splitlines()[2:]
    assert len(block) == len(rows)
    for line, row in zip(block, rows):
        assert row["paper's claim"] in line and f"**{row['verdict']}**" in line
        assert "%, n = " not in line                  # one interval level in the README: the rule is stated once
    counts = [sum(r["verdict"] == v for r in rows) for v in ("reproduced", "contradicted", "inconclusive")]
    assert tally.startswith(f"**{len(rows)} claims: {counts[0]} reproduced, {counts[1]} contradicted, "
                            f"{counts[2]} inconclusive, ")


def test_the_documented_estimate_ignores_what_this_machine_prepared(tmp_path, monkeypatch):
    from mapl.orchestration import progress

    class Cfg:      # only what _prepared_val_tokens reads
        data = object()
    folder = tmp_path / "data" / "corpus"
    folder.mkdir(parents=True)
    monkeypatch.setattr("mapl.data.default_data_dir", lambda data: folder)
    monkeypatch.setattr("mapl.data.read_manifest", lambda f: {"splits": {"val": {"tokens": 1234}}})
    assert progress._prepared_val_tokens(Cfg) == 1234
    with progress.committed_data_only():
        assert progress._prepared_val_tokens(Cfg) is None
