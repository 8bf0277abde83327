"""``RVQSettings``: everything an ``RVQCompressor`` is built from; a run sets the knobs of ``compressor.rvq``
(``mapl.core.config.RVQConfig`` checks their values)."""
from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["RVQSettings"]


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
    scale: str = "none"                    # "token": quantise z / RMS(z_t), the scale sent in bf16: error relative to |z|

    @classmethod
    def from_config(cls, q) -> "RVQSettings":
        return cls(groups=q.groups or None, rounds=q.rounds, codebook_size=q.codebook_size, decay=q.decay,
                   sync=q.sync, max_staleness=q.max_staleness, search_with=q.search_with,
                   tile_bytes=q.search_tile_bytes, search_kernel=q.search_kernel, scale=q.scale)

    def codebook_args(self, dim: int, seed: int) -> dict:
        """The arguments of the sender's and the receiver's :class:`ResidualVQ` (identical at version 0)."""
        mine = {"groups", "rounds", "codebook_size", "decay", "eps", "kmeans_init", "kmeans_iters",
                "dead_code_threshold", "max_revive", "tile_bytes", "search_kernel"}
        args = {f.name: getattr(self, f.name) for f in fields(self) if f.name in mine}
        if args["max_revive"] is None and self.sync == "mirrored":
            # mirrored sync sends max_revive revived codewords (fixed shape) with every message: K/16, not K
            args["max_revive"] = max(1, self.codebook_size // 16)
        return {**args, "dim": dim, "seed": seed}
