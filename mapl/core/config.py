"""Run configuration: nested dataclasses, typed parsing, validation with one-line errors.

A run is ``RunConfig``: a profile of ``params.yaml`` (tracked by DVC), then the method's tuned settings, then CLI
flags and ``--set section.key=value``. Each field's type and allowed values (``setting(..., choices=, min=)``) are
written once; the generic machinery is ``mapl.base.settings``, re-exported here for its callers.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import yaml

from ..data import DataConfig
from .model_config import PRESETS, ModelConfig
from .schedule import ONE_F_ONE_B, SCHEDULES as SCHEDULE_REGISTRY
# re-exported: callers import these from mapl.core.config
from .seeds import DRAWS, run_base
from ..base.settings import (ConfigError, build, check_fields, coerce, field_hints, field_type, parse_set, refuse,
                             set_nested, setting)

__all__ = ["METHODS", "PROJECTORS", "ANCHORS", "SCHEDULES", "PRECISIONS", "RVQ_SYNC_MODES", "RVQ_SEARCH_KERNELS",
           "RVQ_SCALES", "RVQ_SEARCH_WITH", "GRAD_WIRES", "POLAR_METHODS", "CHECKPOINTING_MODES", "NORM_CASTS",
           "ConfigError", "setting", "build", "check_fields", "parse_set", "AnchorConfig", "ProjectorConfig",
           "SPELConfig", "RVQConfig", "CompressorConfig", "TrainConfig", "RunConfig", "PROJECT_ROOT", "RESUMABLE_FIELDS",
           "EXECUTION_FIELDS", "load_params", "load_run_config", "apply_overrides", "config_hash", "hashed_config",
           "flatten_config", "config_diff"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# ---- allowed values: the one source every module imports ---------------------------------------
# method -> its default projector and anchor (ablations override them)
METHODS = {
    "none": dict(projector=None, anchor="none"),
    "int8": dict(projector=None, anchor="none"),
    "ssn": dict(projector="fixed-shared", anchor="static"),
    "mapl": dict(projector="spel", anchor="factorized"),
    "mapl-rvq": dict(projector="spel", anchor="factorized"),
}
PROJECTORS = ("spel", "fixed", "unconstrained", "fixed-shared")
ANCHORS = ("none", "static", "full", "factorized")
SCHEDULES = tuple(SCHEDULE_REGISTRY)          # the schedules the runtime defines (torch-free module)
PRECISIONS = ("auto", "fp32", "bf16")
RVQ_SYNC_MODES = ("stream", "full", "mirrored")
RVQ_SEARCH_KERNELS = ("auto", "matmul", "fused")
GRAD_WIRES = ("same", "int8")                              # mapl/core/compress/gradwire.py says what each does
RVQ_SCALES = ("none", "token")                             # mapl/core/compress/rvq/settings.py says what each does
RVQ_SEARCH_WITH = ("sender", "receiver")
POLAR_METHODS = ("svd", "polar_express")
CHECKPOINTING_MODES = ("off", "on", "auto")               # auto: the memory plan turns it on when a stage does not fit
NORM_CASTS = ("per-linear", "once")                        # mapl/core/model.py's Block says what each does
# settings a checkpoint may be resumed with new values of, when asked (--resume-with-changes; recorded)
RESUMABLE_FIELDS = frozenset({
    "train.steps", "train.lr_muon", "train.lr_adam", "train.lr_embed", "train.lr_head", "train.lr_anchor",
    "train.warmup_steps", "train.min_lr_frac", "train.grad_clip", "train.weight_decay", "train.eval_every",
    "train.eval_tokens", "train.eval_batch_size", "train.schedule", "compressor.projector.lr_mult",
    "train.loss_chunk_tokens", "train.eval_micro_batch_size",
})
# fields added after runs were committed: hashed only when set away from this default, so older runs keep their hash
HASHED_WHEN_SET = {"train.loss_chunk_tokens": 0, "train.eval_micro_batch_size": 0, "train.norm_cast": "per-linear",
                   "compressor.grad_wire": "same"}
# how a run is executed, not what it computes: outside the config hash and every resume decision
EXECUTION_FIELDS = ("run_name", "profile", "train.checkpoint_every", "train.threads", "train.activation_checkpointing",
                    "train.health_every", "train.health_warn_factor", "train.comm_timeout_s")


# ---- the configs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AnchorConfig:
    kind: str | None = setting(None, choices=ANCHORS)      # None = the method's default (METHODS)
    rank: int = setting(0, min=0)                          # 0 = the projector rank r (the paper writes both as r)
    init_std: float = setting(0.0, min=0)                  # E_p starts at 0: training begins as "no anchor"
    static_std: float = setting(1.0, min=0)                # SSN's fixed token shift ~ N(0, std) (ProtocolNanoGPT)


@dataclass(frozen=True)
class ProjectorConfig:
    kind: str | None = setting(None, choices=PROJECTORS)   # None = the method's default (METHODS)
    lr_mult: float = setting(0.1, min_exclusive=0)         # projector LR = lr_mult x Muon LR (paper: 0.1)
    receiver_grad: str = setting("exact", choices=("exact", "drop"))   # the receiver-side term of dL/dA_p
    unconstrained_optimizer: str = setting("muon", choices=("muon", "adamw"))   # the "no constraint" ablation


@dataclass(frozen=True)
class SPELConfig:
    momentum: float = setting(0.95, min=0, max_exclusive=1)
    polar: str = setting("svd", choices=POLAR_METHODS)    # msign and retraction: exact SVD polar factor or Polar Express
    polar_steps: int = setting(10, min=1)


@dataclass(frozen=True)
class RVQConfig:
    groups: int = setting(0, min=0)                        # 0 = r / 2 groups of 2-dim codewords
    rounds: int = setting(2, min=1)
    codebook_size: int = setting(256, min=2, max=65536)    # a power of two (checked in validate)
    decay: float = setting(0.99, min=0, max_exclusive=1)
    sync: str = setting("stream", choices=RVQ_SYNC_MODES)
    max_staleness: int | None = setting(None, min=0)      # None = the sync mode's bound (stream 2*ceil(K/n), else 0)
    search_with: str = setting("receiver", choices=RVQ_SEARCH_WITH)
    search_tile_bytes: int = setting(0, min=0)             # memory budget per search tile; 0 = 4 MiB on CPU, 256 MiB on GPU
    # auto: rvq/native.py's C kernel on CPU (else matmul), fused (compiled) on GPU
    search_kernel: str = setting("auto", choices=RVQ_SEARCH_KERNELS)
    scale: str = setting("none", choices=RVQ_SCALES)       # none: quantise z; token: z / RMS(z_t), scale on the wire (bf16)


@dataclass(frozen=True)
class CompressorConfig:
    method: str = setting("none", choices=tuple(METHODS))
    ratio: float = setting(1.0, min=1)                     # d / r for projections; ignored by none/int8
    projector: ProjectorConfig = setting(factory=ProjectorConfig)
    anchor: AnchorConfig = setting(factory=AnchorConfig)
    spel: SPELConfig = setting(factory=SPELConfig)
    rvq: RVQConfig = setting(factory=RVQConfig)
    int8_block: int = setting(0, min=0)                    # 0 = one absmax scale per token, else per block
    grad_wire: str = setting("same", choices=GRAD_WIRES)   # the projections' backward message (compress/gradwire.py)
    seed: int = setting(1234, min=0)                       # base of the fixed draws (every rank derives them)
    draws: str = setting("per-seed", choices=DRAWS)        # whether the draws follow train.seed (mapl.core.seeds)

    def resolved(self) -> "CompressorConfig":
        d = METHODS[self.method]
        return replace(self, projector=replace(self.projector, kind=self.projector.kind or d["projector"]),
                       anchor=replace(self.anchor, kind=self.anchor.kind or d["anchor"]))

    def validate(self, d_model: int) -> "CompressorConfig":
        check_fields(self, "compressor")
        c = self.resolved()
        if c.projector.kind is not None:
            if c.ratio <= 1:
                refuse("compressor.ratio", c.ratio, f"method {c.method!r} needs ratio > 1 (rank r = d / ratio < d)")
            r = d_model / c.ratio
            if r != int(r) or r < 1:
                refuse("compressor.ratio", c.ratio, f"d_model={d_model} / ratio must be a positive integer rank r; "
                                                    f"reachable ratios divide {d_model}")
        if c.method == "mapl-rvq":
            K = c.rvq.codebook_size
            if K & (K - 1):
                refuse("compressor.rvq.codebook_size", K, "must be a power of two in 2..65536")
            r = c.rank(d_model)
            if r % (c.rvq.groups or max(1, r // 2)):
                refuse("compressor.rvq.groups", c.rvq.groups, f"must divide the rank r={r}")
        if c.grad_wire != "same" and c.projector.kind is None:
            refuse("compressor.grad_wire", c.grad_wire, f"method {c.method!r} sends no r-wide gradient: 'same' only "
                                                        "(int8 quantises both legs itself)")
        if c.int8_block and d_model % c.int8_block:
            refuse("compressor.int8_block", c.int8_block,
                   f"must be 0 (one scale per token) or divide d_model={d_model}")
        if c.anchor.rank > d_model:
            refuse("compressor.anchor.rank", c.anchor.rank, f"must be in [0, d_model={d_model}]")
        if c.projector.kind is None and c.anchor.kind == "factorized" and not c.anchor.rank:
            # without a projector there is no r to default to, and a rank-d factorized anchor would be a full one
            refuse("compressor.anchor.rank", c.anchor.rank,
                   f"method {c.method!r} has no projector rank for the factorized anchor to default to: set it "
                   f"in [1, d_model={d_model}] (MAPL's anchors have r = d_model / ratio, e.g. {d_model // 8} at 8x)")
        return c

    def rank(self, d_model: int) -> int:
        return int(d_model / self.ratio) if self.resolved().projector.kind else d_model


@dataclass(frozen=True)
class TrainConfig:
    steps: int = setting(300, min=1)
    batch_size: int = setting(16, min=1)                   # sequences per optimizer step
    seq_len: int = setting(128, min=1)
    micro_batches: int = setting(4, min=1)                 # pipeline micro-batches per step (divide batch_size)
    lr_muon: float = setting(0.02, min=0)                  # 2-D hidden weights (paper: 0.02 at 150M/500M, 0.01 at 1B)
    lr_adam: float = setting(0.01, min=0)                  # norms / 1-D (paper: 0.5 x Muon)
    lr_embed: float = setting(0.01, min=0)                 # token embedding and anchor tables
    lr_head: float = setting(0.01, min=0)
    lr_anchor: float = setting(0.0, min=0)                 # 0 = same as lr_embed
    muon_momentum: float = setting(0.95, min=0, max_exclusive=1)
    weight_decay: float = setting(0.0, min=0)
    warmup_steps: int = setting(20, min=0)
    min_lr_frac: float = setting(0.1, min=0, max=1)        # linear decay to this fraction of the peak
    grad_clip: float = setting(1.0, min=0)                 # global-norm clipping; 0 = off
    eval_every: int = setting(50, min=1)
    eval_tokens: int = setting(65536, min=0)               # validation tokens read per evaluation; 0 = the whole split
    eval_batch_size: int = setting(16, min=1)
    # evaluate each validation batch this many sequences at a time (equal to ~1e-7, not bitwise); 0 = all at once
    eval_micro_batch_size: int = setting(0, min=0)
    eval_offset: int = setting(0, min=0)                   # skip this many val tokens (a slice of the split)
    # every n-th validation window forms the *selection* set (a best step or tuning winner is chosen there), the
    # others the *report* set (val_loss); 0 = no selection set
    select_every: int = setting(0, min=0)
    checkpoint_every: int = setting(100, min=1)
    health_every: int = setting(50, min=0)                 # steps between boundary-health readings (0 = evaluations only)
    health_warn_factor: float = setting(5.0, min=1)        # warn when a window's max |z| > this x the median of earlier ones
    precision: str = setting("auto", choices=PRECISIONS)   # auto: bf16 autocast on CUDA, fp32 on CPU
    schedule: str = setting("gpipe", choices=SCHEDULES)    # multi-process schedule
    # recompute each block in backward; auto: on when the memory plan does not fit the device without it
    activation_checkpointing: str = setting("off", choices=CHECKPOINTING_MODES)
    # once: each norm's output is cast to bf16 once, not per linear (mapl.core.model.Block)
    norm_cast: str = setting("per-linear", choices=NORM_CASTS)
    # cross-entropy this many tokens at a time, logits recomputed in backward; 0 = one block (equal to 1e-6)
    loss_chunk_tokens: int = setting(0, min=0)
    seed: int = setting(0, min=0)
    threads: int = setting(0, min=0)                       # torch threads (0 = leave as is)
    # multi-process: the longest wait on a peer before the run stops with exit 3 (`--timeout`; NCCL's watchdog too)
    comm_timeout_s: float = setting(60.0, min_exclusive=0)

    def validate(self, stages: int) -> "TrainConfig":
        check_fields(self, "train")
        if self.warmup_steps > self.steps:
            refuse("train.warmup_steps", self.warmup_steps, f"must be <= train.steps={self.steps} (a longer warm-up "
                                                            "never reaches the peak learning rate)")
        if self.batch_size % self.micro_batches:
            refuse("train.micro_batches", self.micro_batches, f"must divide train.batch_size={self.batch_size}")
        if self.schedule in ONE_F_ONE_B and self.micro_batches < stages:
            refuse("train.micro_batches", self.micro_batches,
                   f"{self.schedule} needs at least as many micro-batches as stages ({stages})")
        return self


@dataclass(frozen=True)
class RunConfig:
    profile: str = setting("cpu")
    model: str = setting("tiny", choices=tuple(PRESETS))
    model_overrides: dict = setting(factory=dict)          # ModelConfig fields, e.g. {"d_model": 64}
    stages: int = setting(4, min=1)
    data: DataConfig = setting(factory=DataConfig)
    compressor: CompressorConfig = setting(factory=CompressorConfig)
    train: TrainConfig = setting(factory=TrainConfig)
    data_dir: str = setting("")                            # "" = data/<dataset_dir_name(data)>
    run_name: str = setting("")

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        over = dict(self.model_overrides)
        if vocab_size is not None:
            over["vocab_size"] = vocab_size
        try:
            return ModelConfig.preset(self.model, **over)
        except TypeError as e:               # an unknown ModelConfig field in model_overrides
            raise ConfigError(f"model overrides {sorted(over)}: {e}; allowed: "
                              f"{sorted(f.name for f in fields(ModelConfig))}") from None

    def validate(self, vocab_size: int | None = None) -> "RunConfig":
        """Every check possible before data is opened (with ``vocab_size``, the rest too)."""
        check_fields(self, "")
        asked = self.model_overrides.get("vocab_size")
        if asked is not None and vocab_size is not None and asked < vocab_size:
            refuse("model.vocab_size", asked, f"is smaller than the tokenizer's vocabulary ({vocab_size}); leave it "
                                              "unset (the model takes the tokenizer's size) or use a smaller tokenizer")
        mc = self.model_config(vocab_size)
        if self.stages > mc.n_layers:
            refuse("stages", self.stages, f"must be in [1, n_layers={mc.n_layers}] (each stage owns >= 1 layer)")
        self.train.validate(self.stages)
        if self.train.seq_len > mc.max_seq_len:
            refuse("train.seq_len", self.train.seq_len, f"must be <= model.max_seq_len={mc.max_seq_len}")
        self.data.validate()
        if self.run_name and (not _RUN_NAME.fullmatch(self.run_name) or ".." in self.run_name):
            refuse("run_name", self.run_name, "allowed letters, digits and . _ + = - (no path separator, no '..': "
                                              "it names the run's checkpoint and results files)")
        return replace(self, compressor=self.compressor.validate(mc.d_model))

    def compressor_for(self, d_model: int) -> CompressorConfig:
        """The validated compressor config with ``seed`` this run's draw base (mapl.core.seeds.run_base)."""
        comp = self.compressor.validate(d_model)
        return replace(comp, seed=run_base(comp.seed, self.train.seed, comp.draws))

    def name(self) -> str:
        if self.run_name:
            return self.run_name
        c = self.compressor
        ratio = "" if c.method in ("none", "int8") else f"-{c.ratio:g}x"
        return f"{self.model}-P{self.stages}-{c.method}{ratio}-s{self.train.seed}"

    def to_dict(self) -> dict:
        return asdict(self)


def hashed_config(cfg: RunConfig) -> dict:
    """The config without the fields that change no number (execution fields, defaults hashed only when set)."""
    d = cfg.to_dict()
    for dotted in (*EXECUTION_FIELDS, *HASHED_WHEN_SET):
        *path, last = dotted.split(".")
        node = d
        for part in path:
            node = node[part]
        if dotted in EXECUTION_FIELDS or node.get(last) == HASHED_WHEN_SET[dotted]:
            node.pop(last, None)
    return d


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything that changes the numbers."""
    return hashlib.sha256(json.dumps(hashed_config(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten_config(d: dict, prefix: str = "") -> dict:
    """Dotted field -> value of a ``to_dict()`` result (``model_overrides`` is one value)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and key != "model_overrides":
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_diff(old: dict, new: dict) -> dict[str, tuple]:
    """Dotted field -> (old, new) for every value that differs between two ``to_dict()`` results."""
    a, b = flatten_config(old), flatten_config(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


# ---- params.yaml and overrides -------------------------------------------------------------------
class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """The safe loader (libyaml's where present: 4x faster), refusing a key written twice in one mapping (plain YAML
    keeps the last silently); keys merged in with ``<<`` may be overridden."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep) if key_node.tag != "tag:yaml.org,2002:merge" else None
            if key is not None and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_params(path: Path | None = None) -> dict:
    """The project's ``params.yaml``, with a one-line error when missing or malformed."""
    path = Path(path) if path else PROJECT_ROOT / "params.yaml"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: the profiles live in the project's params.yaml "
                          "(run from a full checkout)") from None
    try:
        params = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(params, dict) or not isinstance(params.get("profiles"), dict):
        raise ConfigError(f"{path}: expected a mapping with a 'profiles:' section")
    return params


_SECTIONS = {"train": TrainConfig, "compressor": CompressorConfig, "data": DataConfig, "model": ModelConfig}
_TOP = {"model", "stages", "data_dir", "run_name"}
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")
_SHORTCUTS = {"method": "compressor.method", "ratio": "compressor.ratio", "projector": "compressor.projector.kind",
              "anchor": "compressor.anchor.kind"}


def _field_type(key: str):
    """The annotation of a dotted key (``train.steps``, ``compressor.rvq.sync``), or ConfigError."""
    section, _, rest = key.partition(".")
    if section in _TOP and not rest:
        return field_hints(RunConfig)[section]
    if section not in _SECTIONS:
        raise ConfigError(f"{key!r} is not a setting: allowed sections {sorted(_SECTIONS)} (as SECTION.KEY), "
                          f"or {sorted(_TOP | set(_SHORTCUTS))}")
    return field_type(_SECTIONS[section], key)


def apply_overrides(tree: dict, overrides: dict, from_string: bool = False) -> dict:
    """Dotted overrides (and the shortcuts ``method``, ``ratio``, ``projector``, ``anchor``) written into a profile
    tree, each converted by its field's type."""
    for key, value in overrides.items():
        if value is None:
            continue
        key = _SHORTCUTS.get(key, key)
        tp = _field_type(key)
        section = key.partition(".")[0]
        converted = coerce(value, tp, key, from_string)
        if section == "model" and "." in key:
            set_nested(tree, "model_overrides." + key.split(".", 1)[1], converted)
        else:
            set_nested(tree, key, converted)
    return tree


# a profile's keys beyond one run's fields: its runs, the methods' tuned settings and the launcher
_PROFILE_KEYS = {f.name for f in fields(RunConfig)} - {"profile"} | {"runs", "method_overrides", "launcher"}


def load_run_config(profile: str, overrides: dict | None = None, params: dict | None = None,
                    from_string: bool = False) -> RunConfig:
    """A profile of params.yaml, then the method's tuned settings, then ``overrides`` (command-line strings with
    ``from_string``)."""
    params = params if params is not None else load_params()
    profiles = params["profiles"]
    if profile not in profiles:
        refuse("profile", profile, f"allowed: {sorted(profiles)}")
    tree = json.loads(json.dumps({k: v for k, v in (profiles[profile] or {}).items() if k != "runs"}))  # a deep copy
    unknown = sorted(set(tree) - _PROFILE_KEYS)
    if unknown:
        raise ConfigError(f"profiles.{profile}: unknown key(s) {unknown}; allowed: {sorted(_PROFILE_KEYS)}")
    tree.pop("launcher", None)
    tuned = tree.pop("method_overrides", None) or {}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    method = overrides.get("method") or overrides.get("compressor.method") or \
        (tree.get("compressor") or {}).get("method", "none")
    apply_overrides(tree, tuned.get(method) or {})                       # the tuning protocol's winners
    apply_overrides(tree, overrides, from_string)
    model_over = tree.pop("model_overrides", {}) or {}
    for key, value in model_over.items():
        coerce(value, _field_type(f"model.{key}"), f"model.{key}")
    cfg = build(RunConfig, {**tree, "profile": profile}, f"profiles.{profile}")
    cfg = replace(cfg, model_overrides=model_over)
    check_fields(cfg, "")
    return cfg
