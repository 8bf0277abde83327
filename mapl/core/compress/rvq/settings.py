"""``RVQSettings``: everything an :class:`~mapl.core.compress.rvq.RVQCompressor` is built from, in one object.

The run's config (``compressor.rvq``, :class:`mapl.core.config.RVQConfig`) sets the knobs a study varies;
the rest keep the library defaults below (tests and benchmarks set them directly). The sender's codebooks
and the receiver's copy are two :class:`ResidualVQ` built from the same :meth:`RVQSettings.codebook_args`
and seed, so they are identical at version 0.

    >>> RVQSettings(rounds=1, sync="full")
    >>> RVQSettings.from_config(cfg.compressor.rvq)
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ...config import RVQ_SCALES, RVQ_SEARCH_WITH

__all__ = ["RVQSettings"]

# How z is scaled before the quantiser (``scale``; README "Choices where the paper is silent"):
#   "none"  the codes quantise z itself (fixed resolution: a token with |z| far beyond the codebooks'
#           reach is decoded with an error the size of itself: benchmarks/rvq_branches.py's blow-up)
#   "token" each token's z is divided by its RMS s_t, sent beside the codes in bf16 (2 B/token), and
#           multiplied back on decode: the error is relative to |z|, like a bf16 wire's
# Which codebooks the sender searches (``search_with``): its own learned ones, or its shadow of the
# receiver's copy (RVQCompressor's docstring says what each does under each sync mode).


@dataclass(frozen=True)
class RVQSettings:
    # the codebooks (ResidualVQ): G groups x R rounds of K codewords, learned by EMA k-means
    groups: int | None = None              # None = r / 2 groups of 2-dim codewords
    rounds: int = 2
    codebook_size: int = 256
    decay: float = 0.99
    eps: float = 1e-5
    kmeans_init: bool = True
    kmeans_iters: int = 10
    dead_code_threshold: float = 1.0
    max_revive: int | None = None          # None = K (mirrored sync: max(1, K / 16))
    tile_bytes: int = 0                    # the search's memory budget per tile; 0 = by device
    search_kernel: str = "auto"
    # the wire
    sync: str = "stream"                   # how the receiver's copy follows (mapl/core/compress/rvq/sync.py)
    stream_fraction: float | None = None   # stream: the share of the codebook sent per message (None: default)
    max_staleness: int | None = None       # None = the sync mode's bound
    search_with: str = "receiver"
    scale: str = "none"
    grad_dtype: torch.dtype = torch.bfloat16    # the backward payload (the gradient on z, not quantised)

    def __post_init__(self):
        if self.search_with not in RVQ_SEARCH_WITH:
            raise ValueError(f"search_with={self.search_with!r} is invalid; allowed: "
                             f"{', '.join(map(repr, RVQ_SEARCH_WITH))}")
        if self.scale not in RVQ_SCALES:
            raise ValueError(f"scale={self.scale!r} is invalid; allowed: {', '.join(map(repr, RVQ_SCALES))}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r} is invalid; allowed: None or an int >= 0")

    @classmethod
    def from_config(cls, q) -> "RVQSettings":
        """From a run's ``compressor.rvq`` (:class:`mapl.core.config.RVQConfig`, validated)."""
        return cls(groups=q.groups or None, rounds=q.rounds, codebook_size=q.codebook_size, decay=q.decay,
                   sync=q.sync, max_staleness=q.max_staleness, search_with=q.search_with,
                   tile_bytes=q.search_tile_bytes, search_kernel=q.search_kernel, scale=q.scale)

    def codebook_args(self, dim: int, seed: int) -> dict:
        """The arguments of each of the two :class:`ResidualVQ` (sender's and receiver's copy)."""
        mine = {"groups", "rounds", "codebook_size", "decay", "eps", "kmeans_init", "kmeans_iters",
                "dead_code_threshold", "max_revive", "tile_bytes", "search_kernel"}
        args = {f.name: getattr(self, f.name) for f in fields(self) if f.name in mine}
        if args["max_revive"] is None and self.sync == "mirrored":
            # mirrored sync sends max_revive revived codewords (fixed shape) with every message: K/16, not K
            args["max_revive"] = max(1, self.codebook_size // 16)
        return {**args, "dim": dim, "seed": seed}
