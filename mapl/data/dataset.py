"""The read API for training: open a prepared, verified folder (never build one); a problem is a one-line
``DataError`` naming the file and the command that fixes it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batches import eval_batches, get_batch
from .config import PROJECT_ROOT, DataConfig, dataset_dir_name, prepare_command
from .shards import TokenShard
from .verify import read_manifest, verified_manifest, verify_file

__all__ = ["Dataset", "open_dataset", "default_data_dir", "load_split"]


def default_data_dir(cfg: DataConfig) -> Path:
    """``<project>/data/<dataset_dir_name(cfg)>``."""
    return PROJECT_ROOT / "data" / dataset_dir_name(cfg)


@dataclass(frozen=True)
class Dataset:
    """A prepared, verified folder: its manifest and the two shards, plus the batch policy."""
    path: Path
    manifest: dict
    train: TokenShard
    val: TokenShard
    sampling: str = "uniform"

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int):
        """The training batch ``(x, y)`` of ``step`` (see :mod:`mapl.data.batches`)."""
        return get_batch(self.train, batch_size, seq_len, seed, step, self.sampling)

    def eval_batches(self, batch_size: int, seq_len: int, max_tokens: int, offset: int = 0, select_every: int = 0,
                     part: str = "report") -> list:
        """Fixed validation batches from token ``offset`` of the val shard (:func:`mapl.data.batches.eval_batches`)."""
        return eval_batches(self.val[offset:], batch_size, seq_len, max_tokens, select_every, part)


def _shard(out: Path, m: dict, split: str, profile: str | None) -> TokenShard:
    entry = m["splits"][split]
    return TokenShard(out / entry["file"], np.dtype(m["dtype"]).newbyteorder("<"), entry["tokens"],
                      fix=prepare_command(profile, rebuild=True))


def open_dataset(cfg: DataConfig, data_dir: str | os.PathLike | None = None, *, profile: str | None = None,
                 full_verify: bool = False) -> Dataset:
    """The prepared data of ``cfg`` in ``data_dir`` (default ``data/<dataset_dir_name>``), verified; a missing,
    truncated, corrupt or other settings' folder is a ``DataError`` (``profile`` makes its suggested command exact)."""
    out = Path(data_dir) if data_dir else default_data_dir(cfg)
    m = verified_manifest(out, cfg, profile, full=full_verify)
    return Dataset(out, m, _shard(out, m, "train", profile), _shard(out, m, "val", profile), cfg.sampling)


def load_split(out_dir: str | os.PathLike, split: str) -> TokenShard:
    """``train`` or ``val`` of a prepared folder, after checking it against the manifest (no config check)."""
    out = Path(out_dir)
    m = read_manifest(out)
    entry = m["splits"][split]
    verify_file(out / entry["file"], entry["sha256"], entry["tokens"] * np.dtype(m["dtype"]).itemsize)
    return _shard(out, m, split, None)
