"""Every seed the compressors derive from ``compressor.seed`` and the run's seed, in one table.

Fixed random state (projector starting points, SSN's shared basis, the anchors' fixed bases, RVQ
codebooks) is never sent between processes: every rank derives it from the same base seed, so it
must be derived the same way everywhere. ``derive_seed(base, purpose, index)`` is that one way:

    seed = base + OFFSETS[purpose] + index        (index: the boundary or stage, 0 for shared state)

    >>> derive_seed(1234, "projector", 2)         # A_2's Haar starting point
    1336

The offsets are the values the results were produced with; changing one changes every number.

The base follows the run's seed (``compressor.draws = "per-seed"``, the default), so seeds resample
the compressor's draws too (SSN's subspace, every projector's start, the anchors, the codebooks), not
only the model's initialisation and the batches:

    base = compressor.seed + RUN_STRIDE * train.seed            (train.seed 0: compressor.seed itself)

``draws = "fixed"`` keeps ``compressor.seed`` for every ``train.seed`` (every seed shares one random
subspace). RUN_STRIDE exceeds every offset + span, so no two runs'
draws share a seed.

    >>> run_base(1234, 2, "per-seed")
    21234
"""
from __future__ import annotations

__all__ = ["OFFSETS", "RUN_STRIDE", "DRAWS", "derive_seed", "run_base"]

# purpose -> (offset, how many indices it may use). The index ranges do not overlap for one base.
OFFSETS: dict[str, tuple[int, int]] = {
    "shared_basis": (0, 1),        # SSN's U (also the "fixed-shared" projector ablation): one for all boundaries
    "static_shift": (7, 1),        # SSN's fixed N(0, std) token shift: one table shared by all stages
    "projector": (100, 100),       # starting point of boundary p's projector A_p (index p)
    "rvq": (200, 100),             # boundary p's RVQ codebooks and k-means / revival draws (index p)
    "anchor": (1000, 1000),        # stage s's anchor: fixed basis and table init (index s)
    "rvq_stream": (7919, 1),       # the stream sync's permutations; its base is the RVQ seed (purpose "rvq")
}


def derive_seed(base: int, purpose: str, index: int = 0) -> int:
    """The seed of ``purpose`` (a key of :data:`OFFSETS`) for boundary/stage ``index``."""
    if purpose not in OFFSETS:
        raise ValueError(f"seed purpose {purpose!r} is invalid; allowed: {', '.join(sorted(OFFSETS))}")
    offset, span = OFFSETS[purpose]
    if not 0 <= index < span:
        raise ValueError(f"seed index {index} for {purpose!r} is invalid; allowed: 0..{span - 1}")
    return base + offset + index


RUN_STRIDE = 10_000
DRAWS = ("per-seed", "fixed")        # compressor.draws: whether the compressor's draws follow train.seed


def run_base(compressor_seed: int, train_seed: int, draws: str = "per-seed") -> int:
    """The base every compressor draw of a run derives from (see the module docstring)."""
    if draws not in DRAWS:
        raise ValueError(f"compressor.draws={draws!r} is invalid; allowed: {', '.join(DRAWS)}")
    return compressor_seed + (RUN_STRIDE * train_seed if draws == "per-seed" else 0)

