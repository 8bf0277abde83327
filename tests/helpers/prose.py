"""Hold the documents' prose to the tables: every number of a sentence that names a table must be printed by it.

The README and ``docs/results.md`` state results in sentences such as "SSN − MAPL is +1.59 points [+1.03,
+2.15] (`headline-paired.md`)". Kept by hand, such a sentence goes stale the day a table changes. This module
finds each sentence (a table row, a list item, a paragraph's sentence), the tables it names (``<name>.md``
that exists in one of :data:`TABLE_DIRS`), the numbers it states, and reports every number that none of the
named tables contains. Numbers are compared as written, after normalising what differs only in print: a
leading ``+``, the typographic minus, thousands separators. Code spans and link targets are not prose; a
block between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` is written by code and held to
its source by its own test, so it is skipped here.

``strict`` adds the rule for a results document: a sentence that states a measured-looking number (a
decimal or a percentage) must name a table at all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TABLE_DIRS", "Finding", "sentences", "numbers", "named_tables", "check_document"]

# where the tables a document may cite live, relative to the checkout (first match wins for a bare name)
TABLE_DIRS = ("reports/cpu/tables", "reports/tables", "reports/cpu/plan/tables", "reports/paper/plan-paper/tables")

# a number: not glued to a word (bf16, fp32 and P4 are names), a sign only where it starts a token
# (so "0-7" is 0 and 7, not 0 and -7)
_NUMBER = re.compile(r"(?<![\w.])[+\-−]?\d+(?:,\d{3})*(?:\.\d+)?|(?<=\d-)\d+(?:,\d{3})*(?:\.\d+)?")
_CODE = re.compile(r"`[^`]*`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_TABLE_NAME = re.compile(r"(?:[\w./-]*/)?([\w-]+\.md)\b")
_GENERATED = re.compile(r"<!-- generated:([\w-]+) -->.*?<!-- /generated:\1 -->", re.S)
# abbreviations whose period does not end a sentence
_ABBREV = ("App.", "e.g.", "i.e.", "vs.", "Fig.", "Eq.", "cf.", "approx.", "etc.", "No.")
_MEASURED = re.compile(r"\d\.\d|\d\s?%")


@dataclass(frozen=True)
class Finding:
    line: int
    sentence: str
    problem: str

    def __str__(self) -> str:
        text = self.sentence if len(self.sentence) <= 160 else self.sentence[:157] + "..."
        return f"line {self.line}: {self.problem}: {text}"


def _normalise(token: str) -> str:
    token = token.replace("−", "-").replace(",", "")
    return token[1:] if token.startswith("+") else token


def numbers(text: str) -> set[str]:
    """Every number of ``text``, normalised (see the module's docstring)."""
    return {_normalise(m.group()) for m in _NUMBER.finditer(text)}


def _prose(text: str) -> str:
    """The text without code spans and link targets (their numbers are not statements)."""
    return _LINK_TARGET.sub("]", _CODE.sub(lambda m: m.group() if _TABLE_NAME.search(m.group()) else "", text))


def sentences(text: str) -> list[tuple[int, str]]:
    """(first line number, sentence) of every table row, heading, list item and sentence of ``text``."""
    text = _GENERATED.sub(lambda m: "\n" * m.group().count("\n"), text)
    out, block, start, in_fence = [], [], 0, False

    def flush():
        if block:
            out.extend(_split(" ".join(block), start))
            block.clear()

    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if not stripped or stripped.startswith(("#", "|", "<!--", "![")):
            flush()
            if stripped.startswith(("#", "|")):
                out.append((i, stripped))
            continue
        if re.match(r"([*-]|\d+\.) ", stripped):      # a list item starts a sentence
            flush()
        if not block:
            start = i
        block.append(stripped)
    flush()
    return out


def _split(paragraph: str, line: int) -> list[tuple[int, str]]:
    pieces, current = [], ""
    for part in re.split(r"(?<=[.!?])\s+(?=[A-Z*(`\[])", paragraph):
        current = f"{current} {part}".strip()
        if not current.endswith(_ABBREV):
            pieces.append((line, current))
            current = ""
    if current:
        pieces.append((line, current))
    return pieces


def named_tables(sentence: str, root: Path) -> list[Path]:
    """The tables ``sentence`` names that exist under ``root`` (a path as written, else a bare name in TABLE_DIRS)."""
    found = []
    for m in _TABLE_NAME.finditer(sentence):
        written, name = m.group(), m.group(1)
        candidates = [root / written] if "/" in written else [root / d / name for d in TABLE_DIRS]
        path = next((p for p in candidates if p.is_file()), None)
        if path is not None and path not in found:
            found.append(path)
    return found


def check_document(path: Path, root: Path, strict: bool = False) -> list[Finding]:
    """Every number of ``path``'s table-naming sentences that its tables do not print (and, with ``strict``,
    every sentence stating a measured-looking number that names no table)."""
    findings = []
    cache: dict[Path, set[str]] = {}
    for line, sentence in sentences(path.read_text()):
        prose = _prose(sentence)
        tables = named_tables(sentence, root)
        if not tables:
            if strict and _MEASURED.search(prose):
                findings.append(Finding(line, sentence, "states a measured number but names no table"))
            continue
        printed = set().union(*(cache.setdefault(t, numbers(t.read_text())) for t in tables))
        missing = sorted(numbers(_TABLE_NAME.sub("", prose)) - printed)
        if missing:
            names = ", ".join(t.name for t in tables)
            findings.append(Finding(line, sentence, f"{', '.join(missing)} not in {names}"))
    return findings
