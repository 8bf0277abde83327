"""``Doc``, one document of a corpus, and tarball reading: below every source (sources and code_corpus)."""
from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Iterator, NamedTuple

__all__ = ["Doc", "tar_files"]


class Doc(NamedTuple):
    name: str
    text: str


def tar_files(tarball: Path) -> Iterator[tuple[list[str], object]]:
    """(path parts, open member) of each file of a ``.tar.gz``, read without extracting."""
    with tarfile.open(tarball, "r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                yield m.name.split("/"), tar.extractfile(m)
