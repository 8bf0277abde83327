"""``DataConfig``: what to tokenize and how (a run's ``data`` section; never imports ``mapl.core.config``, which
imports it)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..base.settings import check_fields, refuse

__all__ = ["DataConfig", "DataError", "MissingDataError", "prepare_command", "dataset_dir_name", "token_config",
           "effective_token_config", "default_cache_dir", "PROJECT_ROOT", "SOURCES", "TOKENIZERS", "DOC_SPLITS"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]

SOURCES = ("shakespeare", "shakespeare-parquet", "sympy-code", "python-code", "text", "parquet", "hf")
TOKENIZERS = ("bpe", "byte", "mistral")
DOC_SPLITS = ("file", "blank-line")
SAMPLINGS = ("uniform", "epochs")


class DataError(ValueError):
    """Data that cannot be used as it is (missing, corrupt, truncated, other settings): one line naming the file (or
    field), what is wrong and the fix."""


class MissingDataError(DataError, FileNotFoundError):
    """A prepared folder, manifest or shard is absent (also a ``FileNotFoundError``)."""


def prepare_command(profile: str | None = None, rebuild: bool = False) -> str:
    """The command that (re)creates a profile's data, quoted for error messages."""
    cmd = f"mapl data --profile {profile or '<profile>'}" + (" --rebuild" if rebuild else "")
    return f"`{cmd}`" if rebuild else f"`{cmd}` (or `dvc repro prepare`)"


@dataclass(frozen=True)
class DataConfig:
    """What to tokenize and how (sources and fields: docs/data.md); every field that changes the tokens is in the
    folder name. ``sampling`` changes no shard, so it is in neither the folder name nor the manifest."""
    source: str = field(default="shakespeare", metadata={"choices": SOURCES})
    paths: tuple[str, ...] = ()
    hf_id: str = "robbiegwaldd/dclm-10B"
    hf_text_field: str = "text"
    tokenizer: str = field(default="bpe", metadata={"choices": TOKENIZERS})
    vocab_size: int = 2048
    val_fraction: float = field(default=0.1, metadata={"min_exclusive": 0.0, "max_exclusive": 1.0})
    val_tokens: int = field(default=0, metadata={"min": 0})
    max_train_tokens: int = field(default=0, metadata={"min": 0})
    seed: int = field(default=0, metadata={"min": 0})
    doc_split: str = field(default="file", metadata={"choices": DOC_SPLITS})
    sampling: str = field(default="uniform", metadata={"choices": SAMPLINGS, "tokens": False})

    def __post_init__(self):
        # YAML and argparse give lists; a frozen dataclass must hold a hashable tuple.
        if isinstance(self.paths, (list, str)):
            object.__setattr__(self, "paths", (self.paths,) if isinstance(self.paths, str) else tuple(self.paths))

    def validate(self) -> "DataConfig":
        """Types and ranges from the field metadata, then the rules that involve several fields."""
        check_fields(self, "data")
        if self.source in ("text", "parquet") and not self.paths:
            refuse("data.paths", self.paths, f"source={self.source!r} needs at least one file or glob")
        if self.source == "hf" and not self.hf_id:
            refuse("data.hf_id", self.hf_id,
                   "source='hf' needs a dataset id (or a builder such as 'parquet' with paths)")
        if not self.hf_text_field:
            refuse("data.hf_text_field", self.hf_text_field, "must name the text column")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 2**32:
            refuse("data.vocab_size", self.vocab_size,
                   "the BPE needs 256 bytes + end-of-text, so allowed: 257 .. 2**32")
        if self.source == "hf" and self.val_tokens == 0:
            refuse("data.val_tokens", self.val_tokens, "source='hf' streams documents of unknown count, so set "
                   "val_tokens > 0 (the first documents worth that many tokens are held out)")
        if self.val_tokens > 0 and self.tokenizer == "bpe":
            refuse("data.val_tokens", self.val_tokens, "a token-counted held-out prefix needs a pretrained "
                   "tokenizer ('byte' or 'mistral'): the BPE is trained on the train split only; use val_fraction")
        return self


def token_config(cfg: DataConfig) -> dict:
    """The fields that change the tokens, as plain JSON (the manifest's ``config``)."""
    d = {k: v for k, v in asdict(cfg).items()
         if next(f for f in fields(DataConfig) if f.name == k).metadata.get("tokens", True)}
    d["paths"] = list(cfg.paths)
    return d


def effective_token_config(config: dict) -> dict:
    """``token_config`` without the fields this source and tokenizer ignore: what two folders must share to hold
    the same tokens."""
    source, prefix = config.get("source"), config.get("val_tokens", 0) > 0
    ignored = {"vocab_size": config.get("tokenizer") != "bpe", "val_fraction": prefix, "seed": prefix,
               "doc_split": source != "text", "hf_id": source != "hf", "hf_text_field": source not in ("parquet", "hf"),
               "paths": source not in ("text", "parquet", "hf")}
    return {k: v for k, v in config.items() if not ignored.get(k)}


def dataset_dir_name(cfg: DataConfig) -> str:
    """Stable folder name, e.g. ``shakespeare-bpe2048``: source and tokenizer, then an 8-hex digest of the other
    token fields that differ from the defaults (``dclm-10b-mistral32k-<hash>``)."""
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in cfg.hf_id.rstrip("/").split("/")[-1].lower())
    src = (slug or "hf") if cfg.source == "hf" else cfg.source
    tok = {"bpe": f"bpe{cfg.vocab_size}", "byte": "byte", "mistral": "mistral32k"}[cfg.tokenizer]
    default = DataConfig()
    keys = ["paths", "hf_text_field", "val_fraction", "val_tokens", "max_train_tokens", "seed", "doc_split"]
    if cfg.source == "hf":
        keys.append("hf_id")        # the slug alone could collide (org/name vs other-org/name)
    extra = {k: getattr(cfg, k) for k in keys
             if getattr(cfg, k) != getattr(default, k) or (k == "hf_id" and cfg.paths)}
    if not extra:
        return f"{src}-{tok}"
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=list).encode()).hexdigest()[:8]
    return f"{src}-{tok}-{digest}"


def default_cache_dir() -> Path:
    """Raw downloads: ``$MAPL_CACHE_DIR`` or ``<project>/data/raw`` (cached, never committed)."""
    return Path(os.environ.get("MAPL_CACHE_DIR") or PROJECT_ROOT / "data" / "raw")
