"""Every seed the compressors derive, in one table. Fixed random state (projector starts, SSN's basis, anchor bases,
RVQ codebooks) is never sent: every rank derives it the same way,

    seed = base + OFFSETS[purpose] + index                  (index: the boundary or stage)
    base = compressor.seed + RUN_STRIDE * train.seed        (draws "per-seed"; "fixed": compressor.seed)

so seeds resample the compressor's draws too. The offsets are those the results were made with.
"""
from __future__ import annotations

__all__ = ["OFFSETS", "RUN_STRIDE", "DRAWS", "derive_seed", "run_base"]

# purpose -> (offset, how many indices it may use); the ranges do not overlap, and RUN_STRIDE exceeds them all
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
    if draws not in DRAWS:
        raise ValueError(f"compressor.draws={draws!r} is invalid; allowed: {', '.join(DRAWS)}")
    return compressor_seed + (RUN_STRIDE * train_seed if draws == "per-seed" else 0)

