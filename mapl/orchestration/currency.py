"""Whether a results JSON is current: this config's, complete, and written by this training code (or by code
proven to compute the same numbers).

The one test that :mod:`mapl.orchestration.reuse` (which run to train, restore, copy or adopt),
:mod:`mapl.orchestration.refresh` (which train stage may be recorded without training) and the frozen-trunk
study apply to a finished run. It lives apart from reuse so that refresh, which reuse's command line calls,
reads it without importing reuse back.
"""
from __future__ import annotations

from pathlib import Path

from ..base.io import read_json_object
from ..core.config import PROJECT_ROOT, RunConfig, config_hash
from .equivalence import proven

__all__ = ["same_code", "results_current"]


def same_code(stamp: str | None, fingerprint: str, root: Path = PROJECT_ROOT) -> bool:
    """Whether training code ``stamp`` computes what ``fingerprint`` computes: it is that code, or ``root``'s
    ``reports/code-equivalence.json`` holds a proof, or a chain of proofs, from ``stamp`` to ``fingerprint``. A
    composite stamp ``<code>+<study>`` matches when the study parts are equal and the code parts proven."""
    if stamp == fingerprint:
        return True
    if stamp is None:
        return False
    # a study that computes numbers outside the fingerprinted sources stamps "<code>+<its own hash>"
    # (mapl.orchestration.frozen_trunk.study_fingerprint): its own part must match, its code part be proven
    code, _, own = stamp.partition("+")
    new_code, _, new_own = fingerprint.partition("+")
    return own == new_own and proven(code, new_code, root) is not None


def results_current(out: Path, cfg: RunConfig, fingerprint: str, root: Path = PROJECT_ROOT) -> bool:
    """The results JSON at ``out`` is this config's, complete, and from this training code (``root``: the
    checkout whose proofs count, :func:`same_code`)."""
    res = read_json_object(out)
    if res is None:
        return False
    prov = res.get("provenance") or {}
    return (prov.get("config_hash") == config_hash(cfg) and res.get("steps") == cfg.train.steps
            and same_code(prov.get("code_fingerprint"), fingerprint, root))
