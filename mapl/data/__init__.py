"""Corpora, tokenizers, token shards and the token-matched batch order (docs/data.md): ``mapl data`` prepares a
folder, a training process reads it with ``open_dataset(cfg.data, data_dir).batch(step, batch_size, seq_len, seed)``.
"""
from .batches import eval_batches, get_batch, take_windows, unigram_entropy, window_starts
from .build import ShardWriter, dtype_for, prepare
from .config import DataConfig, DataError, MissingDataError, dataset_dir_name, default_cache_dir
from .dataset import TOKENIZER_FILE, Dataset, TokenShard, default_data_dir, load_split, open_dataset, read_manifest
from .sources import Doc, load_documents, split_documents
from .tokenizers import byte_tokenizer, encode_documents, eot_id, mistral_tokenizer, train_bpe

__all__ = ["open_dataset", "Dataset", "default_data_dir", "load_split", "read_manifest", "TokenShard", "get_batch",
           "eval_batches", "window_starts", "take_windows", "unigram_entropy", "DataError", "MissingDataError",
           "DataConfig", "dataset_dir_name", "default_cache_dir", "TOKENIZER_FILE", "prepare", "Doc", "load_documents",
           "split_documents", "byte_tokenizer", "train_bpe", "mistral_tokenizer", "eot_id", "encode_documents",
           "ShardWriter", "dtype_for"]
