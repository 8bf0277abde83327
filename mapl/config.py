"""Run configuration: nested dataclasses, typed parsing, validation with one-line errors.

A run is ``RunConfig`` = model preset + data + compressor + train settings + pipeline shape. Profiles
(``micro``, ``cpu``, ``paper-smoke``, ``paper``) live in ``params.yaml`` at the project root so that
DVC tracks them; explicit CLI flags and ``--set section.key=value`` override the profile.

Every field's type comes from its annotation and its allowed values from its metadata (``choices``,
``min``, ``max``, ...): the one place where what is allowed is written down. Values from YAML and
from the command line are converted by the field's type (``--set train.steps=abc`` is refused naming
the field; ``ratio: 4`` and ``--ratio 4.0`` are the same float, so the same config hash), and every
error is a ``ConfigError`` whose message names the field, the value and what is allowed.

    >>> cfg = load_run_config("cpu", overrides={"method": "mapl", "ratio": 8, "train.lr_muon": "0.03"})
    >>> cfg.compressor.spel.momentum
    0.95
"""
from __future__ import annotations

import hashlib
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import yaml

from .data import DataConfig
from .model import PRESETS, ModelConfig

__all__ = ["METHODS", "PROJECTORS", "ANCHORS", "SCHEDULES", "PRECISIONS", "RVQ_SYNC_MODES", "RVQ_SEARCH_KERNELS",
           "POLAR_METHODS",
           "ConfigError", "setting", "AnchorConfig", "ProjectorConfig", "SPELConfig", "RVQConfig",
           "CompressorConfig", "TrainConfig", "RunConfig", "PROJECT_ROOT", "RESUMABLE_FIELDS", "EXECUTION_FIELDS",
           "load_params", "load_run_config", "apply_overrides", "parse_set", "config_hash", "config_diff",
           "check_fields", "coerce"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# ---- allowed values: the one source every module imports ---------------------------------------
# method -> (projector, anchor) defaults; ablations override projector/anchor explicitly
METHODS = {
    "none": dict(projector=None, anchor="none"),
    "int8": dict(projector=None, anchor="none"),
    "ssn": dict(projector="fixed-shared", anchor="static"),
    "mapl": dict(projector="spel", anchor="factorized"),
    "mapl-rvq": dict(projector="spel", anchor="factorized"),
}
PROJECTORS = ("spel", "fixed", "unconstrained", "fixed-shared")
ANCHORS = ("none", "static", "full", "factorized")
SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("auto", "fp32", "bf16")
RVQ_SYNC_MODES = ("stream", "full", "mirrored")
RVQ_SEARCH_KERNELS = ("auto", "matmul", "fused")
POLAR_METHODS = ("svd", "polar_express")
# settings that change neither the model's shape nor its data: a checkpoint may be resumed with new
# values when the user asks for it explicitly (the change is recorded in the results)
RESUMABLE_FIELDS = frozenset({
    "train.steps", "train.lr_muon", "train.lr_adam", "train.lr_embed", "train.lr_head", "train.lr_anchor",
    "train.warmup_steps", "train.min_lr_frac", "train.grad_clip", "train.weight_decay", "train.eval_every",
    "train.eval_tokens", "train.eval_batch_size", "train.schedule", "compressor.projector.lr_mult",
})
# how a run is executed, not what it computes: outside the config hash and every resume decision
EXECUTION_FIELDS = ("run_name", "profile", "train.checkpoint_every", "train.threads", "train.activation_checkpointing")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and what is allowed."""


def _bad(name: str, value, allowed: str):
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def setting(default=None, *, choices=None, min=None, min_exclusive=None, max=None, max_exclusive=None,
            factory=None):
    """A dataclass field whose allowed values travel with it (read by :func:`check_fields`)."""
    meta = {k: v for k, v in dict(choices=choices, min=min, min_exclusive=min_exclusive, max=max,
                                  max_exclusive=max_exclusive).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---- typed conversion ---------------------------------------------------------------------------
_NONE_WORDS = ("none", "null", "~")
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def coerce(value, tp, name: str, from_string: bool = False):
    """``value`` as type ``tp`` (a field annotation), or ConfigError naming ``name``.

    ``from_string``: the value came from the command line, so "3" may be an int and "none" is None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):                       # X | None
        if value is None or (from_string and str(value).strip().lower() in _NONE_WORDS):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, name, from_string)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_string and str(value).strip().lower() in _BOOL_WORDS:
            return _BOOL_WORDS[str(value).strip().lower()]
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_string:
            try:
                return int(str(value).strip())
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-3 (no dot) as a string: a float literal is accepted from YAML too
        if from_string or isinstance(value, str):
            try:
                return float(str(value).strip())
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        items = value
        if from_string and isinstance(value, str):
            items = json.loads(value) if value.strip().startswith("[") else [s for s in value.split(",") if s]
        if isinstance(items, str):
            items = [items]
        if isinstance(items, (list, tuple)):
            return tuple(coerce(v, args[0], name, from_string) for v in items)
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
    else:
        raise TypeError(f"{name}: unsupported field type {tp!r}")      # a bug in a dataclass, not user input
    _bad(name, value, f"must be {_type_name(tp)}")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def check_fields(obj, where: str) -> None:
    """Type and range of every field of a (nested) config dataclass, from its annotations and metadata."""
    hints = _hints(type(obj))
    for f in fields(obj):
        value, name = getattr(obj, f.name), f"{where}.{f.name}" if where else f.name
        if is_dataclass(value):
            check_fields(value, name)
            continue
        value = coerce(value, hints[f.name], name)
        if isinstance(value, float) and not math.isfinite(value):
            _bad(name, value, "must be a finite number")
        _check_range(name, value, f.metadata)


def _check_range(name: str, value, meta) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        _bad(name, value, f"allowed: {', '.join(repr(c) for c in meta['choices'])}")
    if "min" in meta and value < meta["min"]:
        _bad(name, value, f"must be >= {meta['min']}")
    if "min_exclusive" in meta and value <= meta["min_exclusive"]:
        _bad(name, value, f"must be > {meta['min_exclusive']}")
    if "max" in meta and value > meta["max"]:
        _bad(name, value, f"must be <= {meta['max']}")
    if "max_exclusive" in meta and value >= meta["max_exclusive"]:
        _bad(name, value, f"must be < {meta['max_exclusive']}")


def build(cls, values: dict, where: str, from_string: bool = False):
    """A (nested) config dataclass from a dict; unknown keys and wrong types are refused."""
    if not isinstance(values, dict):
        _bad(where, values, f"must be a mapping of {cls.__name__} fields")
    hints = {f.name: _hints(cls)[f.name] for f in fields(cls)}
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(hints)}")
    out = {}
    for key, value in values.items():
        tp, name = hints[key], f"{where}.{key}"
        if isinstance(tp, type) and is_dataclass(tp):
            out[key] = value if isinstance(value, tp) else build(tp, value or {}, name, from_string)
        else:
            out[key] = coerce(value, tp, name, from_string)
    return cls(**out)


# ---- the configs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AnchorConfig:
    """Per-stage token anchors (README "Choices where the paper is silent")."""
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
    """Residual VQ of Z (mapl-rvq); see mapl/compress/rvq for what each knob does."""
    groups: int = setting(0, min=0)                        # 0 = r / 2 groups of 2-dim codewords
    rounds: int = setting(2, min=1)
    codebook_size: int = setting(256, min=2, max=65536)    # a power of two (checked in validate)
    decay: float = setting(0.99, min=0, max_exclusive=1)
    sync: str = setting("stream", choices=RVQ_SYNC_MODES)
    max_staleness: int | None = setting(None, min=0)      # None = the sync mode's bound (stream 2*ceil(K/n), else 0)
    search_with: str = setting("receiver", choices=("sender", "receiver"))
    search_tile_bytes: int = setting(0, min=0)             # memory budget per search tile; 0 = 4 MiB on CPU, 256 MiB on GPU
    search_kernel: str = setting("auto", choices=RVQ_SEARCH_KERNELS)   # auto: matmul on CPU, fused (compiled) on GPU


@dataclass(frozen=True)
class CompressorConfig:
    """Boundary compression. Choices the paper leaves open are fields here (README lists them)."""
    method: str = setting("none", choices=tuple(METHODS))
    ratio: float = setting(1.0, min=1)                     # d / r for projections; ignored by none/int8
    projector: ProjectorConfig = setting(factory=ProjectorConfig)
    anchor: AnchorConfig = setting(factory=AnchorConfig)
    spel: SPELConfig = setting(factory=SPELConfig)
    rvq: RVQConfig = setting(factory=RVQConfig)
    int8_block: int = setting(0, min=0)                    # 0 = one absmax scale per token, else per block
    seed: int = setting(1234, min=0)                       # fixed projector/shift seeds (every rank derives them)

    def resolved(self) -> "CompressorConfig":
        """The method's default projector and anchor filled in."""
        d = METHODS[self.method]
        return replace(self, projector=replace(self.projector, kind=self.projector.kind or d["projector"]),
                       anchor=replace(self.anchor, kind=self.anchor.kind or d["anchor"]))

    def validate(self, d_model: int) -> "CompressorConfig":
        check_fields(self, "compressor")
        c = self.resolved()
        if c.projector.kind is not None:
            if c.ratio <= 1:
                _bad("compressor.ratio", c.ratio, f"method {c.method!r} needs ratio > 1 (rank r = d / ratio < d)")
            r = d_model / c.ratio
            if r != int(r) or r < 1:
                _bad("compressor.ratio", c.ratio, f"d_model={d_model} / ratio must be a positive integer rank r; "
                                                  f"reachable ratios divide {d_model}")
        if c.method == "mapl-rvq":
            K = c.rvq.codebook_size
            if K & (K - 1):
                _bad("compressor.rvq.codebook_size", K, "must be a power of two in 2..65536")
            r = c.rank(d_model)
            if r % (c.rvq.groups or max(1, r // 2)):
                _bad("compressor.rvq.groups", c.rvq.groups, f"must divide the rank r={r}")
        if c.int8_block and d_model % c.int8_block:
            _bad("compressor.int8_block", c.int8_block, f"must be 0 (one scale per token) or divide d_model={d_model}")
        if c.anchor.rank > d_model:
            _bad("compressor.anchor.rank", c.anchor.rank, f"must be in [0, d_model={d_model}]")
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
    eval_tokens: int = setting(65536, min=1)
    eval_batch_size: int = setting(16, min=1)
    eval_offset: int = setting(0, min=0)                   # skip this many val tokens (tuning uses a disjoint slice)
    checkpoint_every: int = setting(100, min=1)
    precision: str = setting("auto", choices=PRECISIONS)   # auto: bf16 autocast on CUDA, fp32 on CPU
    schedule: str = setting("gpipe", choices=SCHEDULES)    # multi-process schedule
    activation_checkpointing: bool = setting(False)        # recompute each block in backward (memory for time)
    seed: int = setting(0, min=0)
    threads: int = setting(0, min=0)                       # torch threads (0 = leave as is)

    def validate(self, stages: int) -> "TrainConfig":
        check_fields(self, "train")
        if self.batch_size % self.micro_batches:
            _bad("train.micro_batches", self.micro_batches, f"must divide train.batch_size={self.batch_size}")
        if self.schedule == "1f1b" and self.micro_batches < stages:
            _bad("train.micro_batches", self.micro_batches, f"1F1B needs at least as many micro-batches as stages ({stages})")
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
        """Every check that can be made before data is touched (and, with ``vocab_size``, the rest)."""
        check_fields(self, "")
        asked = self.model_overrides.get("vocab_size")
        if asked is not None and vocab_size is not None and asked < vocab_size:
            _bad("model.vocab_size", asked, f"is smaller than the tokenizer's vocabulary ({vocab_size}); leave it "
                                            "unset (the model takes the tokenizer's size) or use a smaller tokenizer")
        mc = self.model_config(vocab_size)
        if self.stages > mc.n_layers:
            _bad("stages", self.stages, f"must be in [1, n_layers={mc.n_layers}] (each stage owns >= 1 layer)")
        self.train.validate(self.stages)
        if self.train.seq_len > mc.max_seq_len:
            _bad("train.seq_len", self.train.seq_len, f"must be <= model.max_seq_len={mc.max_seq_len}")
        self.data.validate()
        return replace(self, compressor=self.compressor.validate(mc.d_model))

    def name(self) -> str:
        if self.run_name:
            return self.run_name
        c = self.compressor
        ratio = "" if c.method in ("none", "int8") else f"-{c.ratio:g}x"
        return f"{self.model}-P{self.stages}-{c.method}{ratio}-s{self.train.seed}"

    def to_dict(self) -> dict:
        return asdict(self)


def _normalised(cfg: RunConfig) -> dict:
    d = cfg.to_dict()
    for dotted in EXECUTION_FIELDS:
        *path, last = dotted.split(".")
        node = d
        for part in path:
            node = node[part]
        node.pop(last, None)
    return d


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything that changes the numbers (not the run name, profile or checkpoint cadence)."""
    return hashlib.sha256(json.dumps(_normalised(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_diff(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted field -> (old, new) for every value that differs between two ``to_dict()`` results."""
    out = {}
    for key in sorted(set(old) | set(new)):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict) and key != "model_overrides":
            out.update(config_diff(a, b, name + "."))
        elif a != b:
            out[name] = (a, b)
    return out


# ---- params.yaml and overrides -------------------------------------------------------------------
def load_params(path: Path | None = None) -> dict:
    """The project's ``params.yaml`` (profiles), with a one-line error when missing or malformed."""
    path = Path(path) if path else PROJECT_ROOT / "params.yaml"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: the profiles live in the project's params.yaml "
                          "(run from a full checkout)") from None
    try:
        params = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(params, dict) or not isinstance(params.get("profiles"), dict):
        raise ConfigError(f"{path}: expected a mapping with a 'profiles:' section")
    return params


def parse_set(items) -> dict[str, str]:
    """``["train.lr_muon=0.03", ...]`` -> {"train.lr_muon": "0.03"}; values stay strings until the
    field's type is known (``apply_overrides``)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is invalid: expected SECTION.KEY=VALUE, e.g. --set train.lr_muon=0.03")
        out[key.strip()] = value
    return out


_SECTIONS = {"train": TrainConfig, "compressor": CompressorConfig, "data": DataConfig, "model": ModelConfig}
_TOP = {"model", "stages", "data_dir", "run_name"}
_SHORTCUTS = {"method": "compressor.method", "ratio": "compressor.ratio", "projector": "compressor.projector.kind",
              "anchor": "compressor.anchor.kind"}


def _field_type(key: str):
    """The annotation of a dotted key (``train.steps``, ``compressor.rvq.sync``), or ConfigError."""
    section, _, rest = key.partition(".")
    if section in _TOP and not rest:
        return _hints(RunConfig)[section]
    if section not in _SECTIONS:
        raise ConfigError(f"{key!r} is not a setting: allowed sections {sorted(_SECTIONS)} (as SECTION.KEY), "
                          f"or {sorted(_TOP | set(_SHORTCUTS))}")
    if not rest:
        raise ConfigError(f"{key!r} is a section: set one of its keys, e.g. {key}.{fields(_SECTIONS[section])[0].name}=...")
    cls, parts = _SECTIONS[section], rest.split(".")
    for i, part in enumerate(parts):
        hints = _hints(cls)
        if part not in hints:
            where = ".".join([section, *parts[:i]])
            raise ConfigError(f"{key!r}: {where} has no key {part!r}; allowed: {sorted(hints)}")
        tp = hints[part]
        if isinstance(tp, type) and is_dataclass(tp):
            if i == len(parts) - 1:
                raise ConfigError(f"{key!r} is a section: set one of its keys, e.g. {key}.{fields(tp)[0].name}=...")
            cls = tp
        elif i < len(parts) - 1:
            raise ConfigError(f"{key!r}: {'.'.join([section, *parts[:i + 1]])} is a value, not a section")
    return tp


def _set_nested(tree: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for part in path:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted!r}: {part} is a value in the profile, not a section")
        tree = node
    tree[last] = value


def apply_overrides(tree: dict, overrides: dict, from_string: bool = False) -> dict:
    """Dotted overrides (``train.seed``, ``compressor.rvq.sync``, shortcuts ``method``/``ratio``/
    ``projector``/``anchor``) written into a profile tree, each converted by its field's type."""
    for key, value in overrides.items():
        if value is None:
            continue
        key = _SHORTCUTS.get(key, key)
        tp = _field_type(key)
        section = key.partition(".")[0]
        converted = coerce(value, tp, key, from_string)
        if section == "model" and "." in key:
            _set_nested(tree, "model_overrides." + key.split(".", 1)[1], converted)
        else:
            _set_nested(tree, key, converted)
    return tree


# groups (run specs), method_overrides (tuned settings) and launcher (how runs are started) are read by
# mapl.sweep; they are not fields of one run
_PROFILE_KEYS = {f.name for f in fields(RunConfig)} - {"profile"} | {"groups", "method_overrides", "launcher"}


def load_run_config(profile: str, overrides: dict | None = None, params: dict | None = None,
                    from_string: bool = False) -> RunConfig:
    """Profile from params.yaml + the method's tuned settings + explicit overrides (in that order).

    Override keys: ``method``, ``ratio``, ``projector``, ``anchor``, top-level RunConfig fields and
    dotted ``train.x`` / ``compressor.x`` / ``compressor.rvq.x`` / ``data.x`` / ``model.x``. With
    ``from_string`` the values are command-line strings, converted by each field's type."""
    params = params if params is not None else load_params()
    profiles = params["profiles"]
    if profile not in profiles:
        _bad("profile", profile, f"allowed: {sorted(profiles)}")
    tree = json.loads(json.dumps(profiles[profile] or {}))               # a deep copy
    unknown = sorted(set(tree) - _PROFILE_KEYS)
    if unknown:
        raise ConfigError(f"profiles.{profile}: unknown key(s) {unknown}; allowed: {sorted(_PROFILE_KEYS)}")
    tree.pop("groups", None)
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
