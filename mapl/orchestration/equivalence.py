"""Proving that two versions of the training code compute the same numbers, and keeping the proof.

A refactor of the numerical core changes the training-code fingerprint (``mapl.core.fingerprint``) even
when it changes no number, and a checkpoint stamped with another fingerprint is never reused
(``mapl.orchestration.reuse.decide``). A long retrain running in a second checkout on the code before
the refactor could then never join. :func:`prove` settles it by measurement: it trains the same short
configurations (every method and the ablations' projector and anchor variants) in both checkouts, each
with its own code, and compares every loss, curve, parameter count, wire section and config hash. Only
when all are bit-identical does it record the pair (old fingerprint, new fingerprint) in
``reports/code-equivalence.json``, with what was compared; ``reuse.adopt`` then takes the old code's
checkpoints and stamps them with the new fingerprint. Nothing is recorded on a difference.

    mapl reuse prove ../retrain cpu                # 8 configurations x 2 checkouts, 6 steps each
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..core.config import PROJECT_ROOT

__all__ = ["CONFIGURATIONS", "COMPARED", "EQUIVALENCE_FILE", "checkout_fingerprint", "prove", "proven", "differences"]

EQUIVALENCE_FILE = Path("reports") / "code-equivalence.json"          # relative to the checkout
# the configurations compared: every method, and the projector and anchor variants of the ablations
CONFIGURATIONS: dict[str, list[str]] = {
    "none": ["--method", "none"],
    "int8": ["--method", "int8"],
    "ssn-8x": ["--method", "ssn", "--ratio", "8"],
    "mapl-8x": ["--method", "mapl", "--ratio", "8"],
    "fixed-8x": ["--method", "mapl", "--ratio", "8", "--projector", "fixed"],
    "static-anchor-8x": ["--method", "mapl", "--ratio", "8", "--anchor", "static"],
    "mapl-rvq-8x": ["--method", "mapl-rvq", "--ratio", "8"],
    "mapl-rvq-8x-token-scale": ["--method", "mapl-rvq", "--ratio", "8", "--set", "compressor.rvq.scale=token"],
}
# what two results must share to count as the same numbers (reuse.compare_results uses it too)
COMPARED = ("train_loss_curve", "val_loss_curve", "select_loss_curve", "val_loss", "select_loss", "n_params", "wire")


def _command(root: Path, name: str) -> list[str]:
    """``mapl <name>`` as the checkout at ``root`` spells it after ``python``: ``-m mapl.cli <name>``, or, in a
    checkout from before the ``mapl`` command (a long retrain's), its module ``-m mapl.<name>``."""
    if (root / "mapl" / "cli" / "__main__.py").is_file():
        return ["-m", "mapl.cli", name]
    return ["-m", f"mapl.{name}"]


def _in_checkout(root: Path, command: str, args: list[str]) -> subprocess.CompletedProcess:
    """``mapl <command> <args>`` with the checkout at ``root``'s own code (its folder first on the import path)."""
    return subprocess.run([sys.executable, *_command(root, command), *args], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})


def checkout_fingerprint(root: Path) -> str:
    """The training-code fingerprint of the checkout at ``root``, computed by that checkout's own code."""
    r = _in_checkout(root, "reuse", [])
    if r.returncode != 0 or not r.stdout.strip():
        raise ValueError(f"{root}: `mapl reuse` failed there ({r.stderr.strip()[-300:]})")
    return r.stdout.split()[0]


def _train(root: Path, args: list[str], out: Path) -> dict:
    r = _in_checkout(root, "train", [*args, "--fresh", "--no-progress", "--out", str(out),
                                     "--ckpt", str(out.with_suffix(".pt"))])
    if r.returncode != 0:
        raise ValueError(f"{root}: {' '.join(args)} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    return json.loads(out.read_text())


def differences(a: dict, b: dict) -> list[str]:
    """The compared fields (and the config hash) in which two results differ."""
    out = [k for k in COMPARED if a.get(k) != b.get(k)]
    if (a.get("provenance") or {}).get("config_hash") != (b.get("provenance") or {}).get("config_hash"):
        out.append("config_hash")
    return out


def proven(old: str, new: str, root: Path = PROJECT_ROOT) -> list[dict] | None:
    """The records proving training code ``old`` computes what ``new`` computes, or None: one proof, or a chain
    of them (old -> a -> ... -> new). Each proof is bit-identity on the same configurations, so a chain of them
    is bit-identity between its ends; without the chain, results of code two refactors back would go stale
    although every step between was proven."""
    records = _records(root)
    paths, seen = [(old, [])], {old}
    while paths:                                   # breadth first: the shortest chain
        code, chain = paths.pop(0)
        for r in records:
            if r["old"] != code or r["new"] in seen:
                continue
            if r["new"] == new:
                return [*chain, r]
            seen.add(r["new"])
            paths.append((r["new"], [*chain, r]))
    return None


def _records(root: Path) -> list[dict]:
    path = Path(root) / EQUIVALENCE_FILE
    return json.loads(path.read_text())["proofs"] if path.exists() else []


def prove(old_root: Path, profile: str, steps: int = 6, new_root: Path = PROJECT_ROOT,
          configurations: dict[str, list[str]] | None = None, extra: list[str] = (), log=print) -> dict:
    """Train ``configurations`` for ``steps`` steps in both checkouts; when every result is bit-identical,
    record the proof in ``new_root``'s :data:`EQUIVALENCE_FILE` and return it; else raise ValueError naming
    each configuration and field that differs (nothing is recorded). ``extra``: arguments added to every
    run (tests point the runs at a small corpus)."""
    from ..base.io import atomic_write_json
    old_root, new_root = Path(old_root).resolve(), Path(new_root).resolve()
    configurations = CONFIGURATIONS if configurations is None else configurations
    old_fp, new_fp = checkout_fingerprint(old_root), checkout_fingerprint(new_root)
    if old_fp == new_fp:
        raise ValueError(f"{old_root} and {new_root} have the same training code ({old_fp}): nothing to prove")
    common = ["--profile", profile, "--set", f"train.steps={steps}", "--set", f"train.eval_every={steps}", *extra]
    diffs, started = [], time.time()
    with tempfile.TemporaryDirectory(prefix="mapl-prove-") as tmp:
        for name, args in configurations.items():
            got = [_train(root, [*common, *args], Path(tmp) / f"{side}-{name}.json")
                   for side, root in (("old", old_root), ("new", new_root))]
            found = differences(*got)
            log(f"{name}: {'bit-identical' if not found else 'differs in ' + ', '.join(found)}")
            diffs += [f"{name}: {k}" for k in found]
    if diffs:
        raise ValueError(f"training code {old_fp} and {new_fp} compute different numbers ({'; '.join(diffs)}): "
                         "nothing recorded")
    record = {"old": old_fp, "new": new_fp, "profile": profile, "steps": steps, "configurations": configurations,
              "compared": [*COMPARED, "config_hash"], "extra": list(extra),
              "proved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.time() - started, 1)}
    kept = [r for r in _records(new_root) if (r["old"], r["new"]) != (old_fp, new_fp)]
    atomic_write_json(new_root / EQUIVALENCE_FILE, {"proofs": [*kept, record]})
    return record
