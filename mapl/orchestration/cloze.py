"""Local multiple-choice tasks for tiny models (lm-evaluation-harness task YAMLs in ``mapl/orchestration/tasks``): a
HellaSwag-style cloze made from held-out text. Each item gives a window of the text as context and four lines to
continue it with: the line that follows, and three other lines of the same text of about its length.

The items are text, not tokens, so that runs with different tokenizers answer the same questions; a seeded draw
makes the same items from the same documents. ``mapl eval`` builds each task's JSONL into a data folder (never
committed); the YAMLs read it back through :func:`load_task_data`.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..base.io import atomic_write_text
from ..data.config import DataError, MissingDataError

__all__ = ["CHOICES", "CHANCE", "TASKS_DIR", "ClozeSpec", "cloze_items", "write_task_data", "read_task_meta",
           "load_task_data"]

CHOICES = 4
CHANCE = 1 / CHOICES
TASKS_DIR = Path(__file__).resolve().parent / "tasks"     # the task YAMLs (lm-eval's TaskManager include_path)
# in each task's meta file: data of another format is built again (a new default ClozeSpec is a new format)
_FORMAT = "mapl-cloze-v1"


@dataclass(frozen=True)
class ClozeSpec:
    """How a task's items are drawn from its text."""
    items: int = 500             # questions (fewer when the text has fewer candidate lines)
    context_chars: int = 400     # whole preceding lines, at least this many characters (~115 BPE tokens of prose)
    min_chars: int = 20          # a candidate line's length bounds: shorter lines ("Exeunt.", "}") are too
    max_chars: int = 160         # alike to tell apart, longer ones leave no room for context in 128 tokens
    length_pool: int = 40        # distractors come from this many candidate lines nearest in length to the answer
    seed: int = 0


def _candidate(line: str, spec: ClozeSpec) -> bool:
    return spec.min_chars <= len(line.strip()) <= spec.max_chars


def _context(lines: list[str], end: int, want: int) -> str | None:
    """Whole lines before ``end`` worth at least ``want`` characters, newline-terminated; None if the document
    has fewer before it."""
    taken, size = [], 0
    for line in reversed(lines[:end]):
        taken.append(line)
        size += len(line) + 1
        if size >= want:
            return "\n".join(reversed(taken)) + "\n"
    return None


def _distractors(pool: list[str], lengths: list[int], answer: str, spec: ClozeSpec, rng) -> list[str]:
    """Three lines of ``pool`` (sorted by length) among the ``length_pool`` nearest in length to ``answer``,
    none equal to it: a length cue alone does not pick the answer."""
    at = bisect.bisect_left(lengths, len(answer.strip()))
    lo = max(0, min(at - spec.length_pool // 2, len(pool) - spec.length_pool))
    near = [p for p in pool[lo:lo + spec.length_pool] if p.strip() != answer.strip()]
    picked = rng.choice(len(near), size=CHOICES - 1, replace=False)
    return [near[i] for i in sorted(picked)]


def cloze_items(texts: list[str], spec: ClozeSpec = ClozeSpec()) -> list[dict]:
    """The task's items from ``texts`` (documents, in a fixed order): ``{"id", "context", "choices", "label",
    "doc", "line"}``, the same for the same texts and spec."""
    docs = [text.split("\n") for text in texts]
    pool = sorted({line.rstrip() for lines in docs for line in lines if _candidate(line, spec)},
                  key=lambda s: (len(s.strip()), s))
    if len(pool) <= spec.length_pool:
        raise DataError(f"a cloze task needs more than {spec.length_pool} distinct lines of {spec.min_chars}-"
                        f"{spec.max_chars} characters; its text has {len(pool)}")
    lengths = [len(p.strip()) for p in pool]
    found = [(d, i, ctx) for d, lines in enumerate(docs) for i, line in enumerate(lines)
             if _candidate(line, spec) and (ctx := _context(lines, i, spec.context_chars)) is not None]
    if not found:
        raise DataError(f"no line of the text has {spec.context_chars} characters of context before it")
    rng = np.random.default_rng(spec.seed)
    chosen = sorted(rng.choice(len(found), size=min(spec.items, len(found)), replace=False))
    items = []
    for k, j in enumerate(chosen):
        d, i, ctx = found[j]
        answer = docs[d][i].rstrip()
        choices = _distractors(pool, lengths, answer, spec, rng)
        label = int(rng.integers(CHOICES))
        choices.insert(label, answer)
        items.append({"id": k, "context": ctx, "choices": choices, "label": label, "doc": d, "line": i})
    return items


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".meta.json")


def write_task_data(path: Path, items: list[dict], spec: ClozeSpec, source: str) -> None:
    """The items as JSONL at ``path`` and, beside it, what made them (``<name>.meta.json``), both atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    meta = {"format": _FORMAT, "spec": asdict(spec), "source": source, "items": len(items), "choices": CHOICES,
            "chance": CHANCE}
    atomic_write_text(_meta_path(path), json.dumps(meta, indent=1) + "\n")


def read_task_meta(path: Path, source: str, spec: ClozeSpec | None = None) -> dict | None:
    """The meta of the data at ``path`` if this builder made it from ``source`` (with ``spec``, unless None), else
    None."""
    try:
        meta = json.loads(_meta_path(Path(path)).read_text())
    except (OSError, ValueError):
        return None
    same = Path(path).is_file() and meta.get("format") == _FORMAT and meta.get("source") == source and \
        (spec is None or meta.get("spec") == asdict(spec))
    return meta if same else None


def load_task_data(jsonl: str, data_dir: str | None = None, **_ignored) -> dict:
    """lm-eval's ``custom_dataset`` of the local tasks: ``{"test": Dataset}`` from ``<data_dir>/<jsonl>``.
    ``data_dir`` comes from the TaskManager's metadata (``mapl eval --task-data``); lm-eval adds its own keys."""
    import datasets
    from ..data.config import PROJECT_ROOT
    path = Path(data_dir or PROJECT_ROOT / "data" / "tasks") / jsonl
    if not path.is_file():
        raise MissingDataError(f"{path} not found: `mapl eval` builds a local task's data before scoring it")
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(items)}
