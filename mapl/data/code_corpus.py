"""``python-code``: every distinct ``.py`` file of five pinned PyPI sdists, one document named ``<package>/<path>``
each, enough that no run of the scale ladder reads a window twice. The standard library is left out on purpose:
its sources would change with the interpreter.
"""
from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path
from typing import NamedTuple

from .documents import Doc, tar_files
from .downloads import SYMPY_SHA256, SYMPY_SPEC, SYMPY_TARBALL, fetch_sdist
from .errors import DataError

__all__ = ["CodePackage", "CODE_PACKAGES", "fetch_code_packages", "code_documents", "code_inventory"]


class CodePackage(NamedTuple):
    """One pinned sdist: ``spec`` (``name==version``), its file name, sha256 and licence (SPDX)."""
    spec: str
    tarball: str
    sha256: str
    licence: str

    @property
    def name(self) -> str:
        return self.spec.split("==")[0]


CODE_PACKAGES: tuple[CodePackage, ...] = (
    CodePackage(SYMPY_SPEC, SYMPY_TARBALL, SYMPY_SHA256, "BSD-3-Clause"),
    CodePackage("django==5.2.8", "django-5.2.8.tar.gz",
                "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f", "BSD-3-Clause"),
    CodePackage("twisted==25.5.0", "twisted-25.5.0.tar.gz",
                "1deb272358cb6be1e3e8fc6f9c8b36f78eb0fa7c2233d2dbe11ec6fee04ea316", "MIT"),
    CodePackage("networkx==3.5", "networkx-3.5.tar.gz",
                "d4c6f9cf81f52d69230866796b82afbccdec3db7ae4fbd1b65ea750feed50037", "BSD-3-Clause"),
    CodePackage("pygments==2.19.2", "pygments-2.19.2.tar.gz",
                "636cb2477cec7f8952536970bc533bc43743542f70392ae026374600add5b887", "BSD-2-Clause"),
)


def fetch_code_packages(cache_dir: Path | None = None,
                        packages: tuple[CodePackage, ...] | None = None) -> list[tuple[CodePackage, Path]]:
    """Each package's sdist (default :data:`CODE_PACKAGES`), sha256-checked; pip runs only for those not cached."""
    return [(p, fetch_sdist(p.spec, p.tarball, p.sha256, cache_dir)) for p in packages or CODE_PACKAGES]


def _modules(package: CodePackage, tarball: Path):
    """(path inside the sdist without its top folder, text) of each ``.py`` file, sorted by path."""
    out = []
    try:
        for parts, f in tar_files(tarball):
            if len(parts) >= 2 and parts[-1].endswith(".py"):
                try:
                    out.append(("/".join(parts[1:]), f.read().decode("utf-8")))
                except UnicodeDecodeError:         # a test fixture in another encoding: not text we train on
                    continue
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{tarball}: not a readable sdist of {package.spec} ({e}); delete it and run the same "
                        "command to fetch it again") from None
    if not out:
        raise DataError(f"{tarball}: no .py file inside (expected the sources of {package.spec})")
    return sorted(out)


def code_documents(fetched: list[tuple[CodePackage, Path]]):
    """One ``Doc`` per distinct, non-empty Python file, in the packages' order (each sdist's paths sorted)."""
    seen, docs = set(), []
    for package, tarball in fetched:
        for path, text in _modules(package, tarball):
            if not text.strip():
                continue
            digest = hashlib.sha256(text.encode()).digest()
            if digest in seen:
                continue
            seen.add(digest)
            docs.append(Doc(f"{package.name}/{path}", text))
    return docs


def code_inventory(docs, packages: tuple[CodePackage, ...] | None = None) -> list[dict]:
    """Per package (default :data:`CODE_PACKAGES`): spec, sha256, licence, and the modules and characters kept."""
    packages = packages or CODE_PACKAGES
    counts = {p.name: [0, 0] for p in packages}
    for d in docs:
        c = counts.get(d.name.split("/", 1)[0])
        if c is not None:
            c[0] += 1
            c[1] += len(d.text)
    return [{"package": p.spec, "sha256": p.sha256, "licence": p.licence, "modules": counts[p.name][0],
             "characters": counts[p.name][1]} for p in packages]
