"""Residual vector quantisation of the projected Z (method ``mapl-rvq``, the paper's MAPL+VQ): ``codebook``
(grouped residual VQ with EMA k-means codebooks), ``search`` (the nearest-codeword search), ``sync`` (how the
receiver's codebook copy follows the sender's), ``settings`` and ``compressor``. docs/architecture.md, "RVQ",
says why the defaults (K=256, 2-dim codewords, 2 rounds: r bytes per token) are what they are."""
from .codebook import OP_EMA, OP_INIT, ResidualVQ
from .compressor import RVQCompressor
from .settings import RVQSettings
from .sync import SYNC_STRATEGIES

__all__ = ["ResidualVQ", "RVQCompressor", "RVQSettings", "OP_EMA", "OP_INIT", "SYNC_STRATEGIES"]
