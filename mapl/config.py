"""Run configuration: dataclasses, profiles from ``params.yaml``, validation with clear errors.

A run is ``RunConfig`` = model preset + data + compressor + train settings + pipeline shape. Profiles
(``micro``, ``cpu``, ``paper``) live in ``params.yaml`` at the project root so that DVC tracks them;
explicit CLI flags override the profile (``mapl.train``).

    >>> cfg = load_run_config("cpu", overrides={"method": "mapl", "ratio": 8})
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from .data import DataConfig
from .model import PRESETS, ModelConfig

__all__ = ["METHODS", "ANCHORS", "PROJECTORS", "CompressorConfig", "TrainConfig", "RunConfig",
           "PROJECT_ROOT", "load_params", "load_run_config", "config_hash"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# method -> (projector, anchor) defaults; ablations override projector/anchor explicitly.
METHODS = {
    "none": dict(projector=None, anchor="none"),
    "int8": dict(projector=None, anchor="none"),
    "ssn": dict(projector="fixed-shared", anchor="static"),
    "mapl": dict(projector="spel", anchor="factorized"),
    "mapl-rvq": dict(projector="spel", anchor="factorized"),
}
PROJECTORS = ("spel", "fixed", "unconstrained", "fixed-shared")
ANCHORS = ("none", "static", "full", "factorized")


def _bad(field_name: str, value, allowed: str):
    raise ValueError(f"{field_name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class CompressorConfig:
    """Boundary compression. Choices the paper leaves open are fields here (README lists them)."""
    method: str = "none"
    ratio: float = 1.0                 # d / r for projections; ignored by none/int8
    projector: str | None = None       # None = the method's default (METHODS)
    anchor: str | None = None
    anchor_rank: int = 0               # 0 = same as the projector rank r (paper writes both as r)
    anchor_init_std: float = 0.0       # E_p starts at 0: the run begins as "no anchor" and learns it
    static_anchor_std: float = 1.0     # SSN's fixed token shift ~ N(0, 1) (ProtocolNanoGPT)
    receiver_grad: str = "exact"       # "exact": A_p gets the receiver-side term too (sent back, metered); "drop"
    proj_lr_mult: float = 0.1          # SPEL LR = mult x Muon LR (paper: 0.1)
    spel_momentum: float = 0.95
    spel_polar: str = "svd"            # retraction/msign: exact SVD polar factor or "polar_express"
    spel_polar_steps: int = 10
    unconstrained_optimizer: str = "muon"   # ablation "learned without constraint": muon | adamw
    int8_block: int = 0                # 0 = one absmax scale per token, else per block of this many values
    # residual VQ (mapl-rvq)
    rvq_groups: int = 0                # 0 = default: r / 2 groups of 2-dim codewords (see mapl/compress/rvq.py)
    rvq_rounds: int = 2
    rvq_codebook_size: int = 256
    rvq_decay: float = 0.99
    rvq_sync: str = "stream"           # stream | full | mirrored
    rvq_max_staleness: int = 1000
    rvq_search_with: str = "receiver"  # encode against the codebook the receiver holds (sender mirrors it)
    seed: int = 1234                   # fixed projector/shift seeds (shared by all ranks, never sent)

    def resolved(self) -> "CompressorConfig":
        if self.method not in METHODS:
            _bad("method", self.method, f"allowed: {sorted(METHODS)}")
        d = METHODS[self.method]
        return replace(self, projector=self.projector or d["projector"], anchor=self.anchor or d["anchor"])

    def validate(self, d_model: int, vocab_size: int) -> "CompressorConfig":
        c = self.resolved()
        if c.projector is not None and c.projector not in PROJECTORS:
            _bad("projector", c.projector, f"allowed: {list(PROJECTORS)}")
        if c.anchor not in ANCHORS:
            _bad("anchor", c.anchor, f"allowed: {list(ANCHORS)}")
        if c.receiver_grad not in ("exact", "drop"):
            _bad("receiver_grad", c.receiver_grad, "allowed: 'exact', 'drop'")
        if c.spel_polar not in ("svd", "polar_express"):
            _bad("spel_polar", c.spel_polar, "allowed: 'svd', 'polar_express'")
        if c.unconstrained_optimizer not in ("muon", "adamw"):
            _bad("unconstrained_optimizer", c.unconstrained_optimizer, "allowed: 'muon', 'adamw'")
        if c.projector is not None:
            if c.ratio <= 1:
                _bad("ratio", c.ratio, f"method {c.method!r} needs ratio > 1 (rank r = d / ratio < d)")
            r = d_model / c.ratio
            if r != int(r) or r < 1:
                _bad("ratio", c.ratio, f"d_model={d_model} / ratio must be a positive integer rank r; "
                                       f"reachable ratios divide {d_model}")
        if c.method == "mapl-rvq":
            K = c.rvq_codebook_size
            if K < 2 or K & (K - 1):
                _bad("rvq_codebook_size", K, "must be a power of two >= 2")
            g = c.rvq_groups or max(1, c.rank(d_model) // 2)
            if c.rank(d_model) % g:
                _bad("rvq_groups", c.rvq_groups, f"must divide the rank r={c.rank(d_model)}")
            if c.rvq_sync not in ("stream", "full", "mirrored"):
                _bad("rvq_sync", c.rvq_sync, "allowed: 'stream', 'full', 'mirrored'")
            if c.rvq_search_with not in ("sender", "receiver"):
                _bad("rvq_search_with", c.rvq_search_with, "allowed: 'sender', 'receiver'")
        if c.int8_block < 0 or (c.int8_block and d_model % c.int8_block):
            _bad("int8_block", c.int8_block, f"must be 0 (one scale per token) or divide d_model={d_model}")
        if c.anchor_rank < 0 or c.anchor_rank > d_model:
            _bad("anchor_rank", c.anchor_rank, f"must be in [0, d_model={d_model}]")
        return c

    def rank(self, d_model: int) -> int:
        return int(d_model / self.ratio) if self.resolved().projector else d_model


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16               # sequences per optimizer step
    seq_len: int = 128
    micro_batches: int = 4             # pipeline micro-batches per step (batch_size % micro_batches == 0)
    lr_muon: float = 0.02              # 2-D hidden weights (paper: 0.02 at 150M/500M, 0.01 at 1B)
    lr_adam: float = 0.01              # norms / 1-D (paper: 0.5 x Muon)
    lr_embed: float = 0.01             # token embedding and anchor tables
    lr_head: float = 0.01
    lr_anchor: float = 0.0             # 0 = same as lr_embed
    muon_momentum: float = 0.95
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_frac: float = 0.1           # linear decay to this fraction of the peak
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_tokens: int = 65536
    eval_batch_size: int = 16
    eval_offset: int = 0               # skip this many val tokens: tuning evaluates on tokens the report never uses
    checkpoint_every: int = 100
    precision: str = "auto"            # auto: bf16 autocast on CUDA, fp32 on CPU
    schedule: str = "gpipe"            # multi-process schedule: gpipe | 1f1b
    seed: int = 0
    threads: int = 0                   # torch threads (0 = leave as is)

    def validate(self, stages: int) -> "TrainConfig":
        for f in ("steps", "batch_size", "seq_len", "micro_batches", "eval_every", "eval_tokens", "eval_batch_size"):
            if getattr(self, f) < 1:
                _bad(f"train.{f}", getattr(self, f), "must be a positive integer")
        if self.batch_size % self.micro_batches:
            _bad("train.micro_batches", self.micro_batches, f"must divide batch_size={self.batch_size}")
        if self.precision not in ("auto", "fp32", "bf16"):
            _bad("train.precision", self.precision, "allowed: 'auto', 'fp32', 'bf16'")
        if self.schedule not in ("gpipe", "1f1b"):
            _bad("train.schedule", self.schedule, "allowed: 'gpipe', '1f1b'")
        if self.schedule == "1f1b" and self.micro_batches < stages:
            _bad("train.micro_batches", self.micro_batches, f"1F1B needs at least as many micro-batches as stages ({stages})")
        if not 0 <= self.min_lr_frac <= 1:
            _bad("train.min_lr_frac", self.min_lr_frac, "must be in [0, 1]")
        return self


@dataclass(frozen=True)
class RunConfig:
    profile: str = "cpu"
    model: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    stages: int = 4
    data: DataConfig = field(default_factory=DataConfig)
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data_dir: str = ""                 # "" = data/<dataset_dir_name(data)>
    run_name: str = ""

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        over = dict(self.model_overrides)
        if vocab_size is not None:
            over["vocab_size"] = vocab_size
        return ModelConfig.preset(self.model, **over)

    def validate(self, vocab_size: int | None = None) -> "RunConfig":
        if self.model not in PRESETS:
            _bad("model", self.model, f"allowed: {sorted(PRESETS)}")
        asked = self.model_overrides.get("vocab_size")
        if asked is not None and vocab_size is not None and asked < vocab_size:
            _bad("model.vocab_size", asked, f"is smaller than the tokenizer's vocabulary ({vocab_size}); "
                                            "leave it unset (the model takes the tokenizer's size) or use a smaller tokenizer")
        mc = self.model_config(vocab_size)
        if self.stages < 1 or self.stages > mc.n_layers:
            _bad("stages", self.stages, f"must be in [1, n_layers={mc.n_layers}] (each stage owns >= 1 layer)")
        self.train.validate(self.stages)
        if self.train.seq_len > mc.max_seq_len:
            _bad("train.seq_len", self.train.seq_len, f"must be <= model.max_seq_len={mc.max_seq_len}")
        comp = self.compressor.validate(mc.d_model, mc.vocab_size)
        self.data.validate()
        return replace(self, compressor=comp)

    def name(self) -> str:
        if self.run_name:
            return self.run_name
        c = self.compressor
        ratio = "" if c.method in ("none", "int8") else f"-{c.ratio:g}x"
        return f"{self.model}-P{self.stages}-{c.method}{ratio}-s{self.train.seed}"

    def to_dict(self) -> dict:
        return asdict(self)


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything that changes the numbers (not the run name)."""
    d = cfg.to_dict()
    d.pop("run_name", None)
    d["train"].pop("checkpoint_every", None)
    d["train"].pop("threads", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_params(path: Path | None = None) -> dict:
    path = Path(path) if path else PROJECT_ROOT / "params.yaml"
    with open(path) as f:
        return yaml.safe_load(f)


def _build(cls, values: dict, where: str):
    names = {f.name for f in fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(names)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def load_run_config(profile: str, overrides: dict | None = None, params: dict | None = None) -> RunConfig:
    """Profile from params.yaml + overrides. Override keys: top-level RunConfig fields, ``method``,
    ``ratio`` and dotted ``train.x`` / ``compressor.x`` / ``data.x`` / ``model.x``."""
    params = params if params is not None else load_params()
    profiles = params.get("profiles", {})
    if profile not in profiles:
        _bad("profile", profile, f"allowed: {sorted(profiles)}")
    p = json.loads(json.dumps(profiles[profile]))          # deep copy
    sections = {"train": p.pop("train", {}), "compressor": p.pop("compressor", {}), "data": p.pop("data", {}),
                "model": p.pop("model_overrides", {})}
    p.pop("groups", None)
    method_over = p.pop("method_overrides", {}) or {}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    method = overrides.get("method", sections["compressor"].get("method", "none"))
    # per-method tuned settings (the tuning protocol's outcome), below explicit overrides
    overrides = {**(method_over.get(method) or {}), **overrides}
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("method", "ratio"):
            sections["compressor"][key] = value
        elif "." in key:
            sec, sub = key.split(".", 1)
            if sec not in sections:
                _bad("override", key, f"section must be one of {sorted(sections)}")
            sections[sec][sub] = value
        else:
            p[key] = value
    cfg = _build(RunConfig, {**p, "profile": profile}, f"profiles.{profile}")
    return replace(cfg,
                   model_overrides=sections["model"],
                   train=_build(TrainConfig, sections["train"], f"profiles.{profile}.train"),
                   compressor=_build(CompressorConfig, sections["compressor"], f"profiles.{profile}.compressor"),
                   data=_build(DataConfig, sections["data"], f"profiles.{profile}.data"))
