"""Residual vector quantisation of the projected activation Z (method ``mapl-rvq``, the paper's MAPL+VQ).

Three pieces:

* ``codebook.py`` -- :class:`ResidualVQ`: grouped residual VQ with EMA k-means codebooks (search,
  lookup, k-means init, EMA update, dead-code revival); ``search.py`` holds the nearest-codeword
  search itself (tiles from a memory budget; a matmul kernel for CPUs, a fused one for GPUs).
* ``sync.py`` -- how the receiver's codebook copy follows the sender's: ``stream`` (the paper's),
  ``full`` and ``mirrored``, three strategies behind one interface.
* ``settings.py`` -- :class:`RVQSettings`: everything the compressor is built from, in one object
  (``RVQSettings.from_config`` reads a run's ``compressor.rvq``).
* ``compressor.py`` -- :class:`RVQCompressor`: the inner projection (``encode``/``decode``) followed,
  on the wire only, by RVQ of z. The sender owns the learned codebooks; the receiver decodes with its
  *own* copy, kept in step by the sync strategy's tensors piggybacked on every forward message and
  metered as overhead.

Defaults: K=256, G=r/2 groups (2-dim codewords), R=2 rounds -> G*R*8 = 8r bits = r bytes/token, half
of MAPL's bf16 z (2r bytes/token). Among the 8-bit/dim layouts with K=256 (codeword dims ds = rounds
R = 1, 2, 4, 8; same search cost) on synthetic r=64 data after EMA training, 2x2 was the robust
choice: scalar (1x1) was 8-15% better on Gaussian data but 2x worse on heavy-tailed (Student-t)
data; 4x4 was 15-55% worse on Gaussian-like data and similar on heavy tails; 8x8 was worst. Its
codebooks (and the sync stream) are also half the size of the 4x4 layout's. Higher ratios: R=1 ->
4 bits/dim (4x over bf16); 4-dim codewords (G=r/4) with R=1 -> 2 bits/dim (8x over bf16, i.e. 32x
overall at a 4x projection); or fewer groups. Search cost is proportional to
``tokens * G * R * K * dim/G = tokens * r * R * K``.

    >>> comp = RVQCompressor(ProjectionCompressor(d, A, "spel"), RVQSettings(groups=r // 2, rounds=2, codebook_size=256))
"""
from .codebook import OP_EMA, OP_INIT, OP_NONE, ResidualVQ
from .compressor import RVQCompressor
from .settings import RVQSettings
from .sync import SYNC_STRATEGIES, CodebookSync, FullSync, MirroredSync, StreamSync

__all__ = ["ResidualVQ", "RVQCompressor", "RVQSettings", "OP_NONE", "OP_EMA", "OP_INIT", "CodebookSync", "StreamSync",
           "FullSync", "MirroredSync", "SYNC_STRATEGIES"]
