"""Every seed the compressors derive from ``compressor.seed``, in one table.

Fixed random state (projector starting points, SSN's shared basis, the anchors' fixed bases, RVQ
codebooks) is never sent between processes: every rank derives it from the same base seed, so it
must be derived the same way everywhere. ``derive_seed(base, purpose, index)`` is that one way:

    seed = base + OFFSETS[purpose] + index        (index: the boundary or stage, 0 for shared state)

    >>> derive_seed(1234, "projector", 2)         # A_2's Haar starting point
    1336

The offsets are the values the results were produced with; changing one changes every number.
"""
from __future__ import annotations

__all__ = ["OFFSETS", "derive_seed"]

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
