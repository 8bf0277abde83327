"""The model's shape, :class:`ModelConfig`, and the size presets; torch-free, so a config validates before torch loads."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["ModelConfig", "PRESETS", "count_params"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4          # < n_heads: grouped-query attention
    ffn_hidden: int = 384        # SwiGLU hidden width
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> "ModelConfig":
        def bad(field, value, allowed):
            raise ValueError(f"model.{field}={value!r} is invalid: {allowed}")
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, field) < 1:
                bad(field, getattr(self, field), "must be a positive integer")
        if self.d_model % self.n_heads:
            bad("n_heads", self.n_heads, f"must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            bad("n_heads", self.n_heads, "head_dim = d_model / n_heads must be even for RoPE")
        return self

    @staticmethod
    def preset(name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"model={name!r} is unknown; allowed: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides).validate()

    def to_dict(self) -> dict:
        return asdict(self)


# The paper gives only d per size; layers, heads and FFN are ours: the parameter count at vocab 32000 matches the
# name within 10% and the layers divide by 8 (tests/test_model.py checks both).
PRESETS: dict[str, ModelConfig] = {
    # CPU presets (vocab set by the tokenizer at run time)
    "micro": ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=192, max_seq_len=64),
    "tiny": ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=384, max_seq_len=256),
    "mini": ModelConfig(vocab_size=2048, d_model=256, n_layers=8, n_heads=4, n_kv_heads=4, ffn_hidden=704, max_seq_len=256),
    # the scale ladder (params.yaml `ladder`): 8 layers (two blocks per stage at P = 4), head width 32, SwiGLU 2.75 d;
    # only d changes, so non-embedding parameters grow as d^2 (0.40M to 6.42M)
    **{f"ladder-d{d}": ModelConfig(vocab_size=2048, d_model=d, n_layers=8, n_heads=d // 32, n_kv_heads=d // 32,
                                   ffn_hidden=11 * d // 4, max_seq_len=256) for d in (64, 96, 128, 160, 192, 256)},
    # paper sizes (d from the paper; the rest chosen here)
    "150M": ModelConfig(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_hidden=2816, max_seq_len=2048),
    "500M": ModelConfig(vocab_size=32000, d_model=1536, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=4096, max_seq_len=2048),
    "1B": ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=7168, max_seq_len=2048),
}


def count_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameter count without building the model."""
    d, f, hd = cfg.d_model, cfg.ffn_hidden, cfg.head_dim
    attn = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    block = attn + 3 * d * f + 2 * d
    total = cfg.n_layers * block + d
    if include_embeddings:
        total += 2 * cfg.vocab_size * d
    return total
