"""Typed settings: dataclass fields that carry their allowed values (``setting``), checked by ``check_fields`` and
converted by ``coerce`` and ``build``; every error is one ``ConfigError`` line naming the field, the value and what
is allowed. Knows no project setting (``mapl.core.config`` imports it, never the reverse).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import operator
import types
import typing
from dataclasses import field, fields, is_dataclass

__all__ = ["ConfigError", "refuse", "setting", "coerce", "field_hints", "check_fields", "build", "field_type",
           "parse_set", "set_nested", "QUANTITIES", "check_quantity"]


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and what is allowed."""


def refuse(name: str, value, allowed: str):
    """Raise the one-line :class:`ConfigError` for field ``name`` holding ``value``."""
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def setting(default=None, *, choices=None, min=None, min_exclusive=None, max=None, max_exclusive=None,
            factory=None):
    """A dataclass field whose allowed values travel with it (read by :func:`check_fields`)."""
    meta = {k: v for k, v in dict(choices=choices, min=min, min_exclusive=min_exclusive, max=max,
                                  max_exclusive=max_exclusive).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---- quantities a command flag and a notebook parameter share ------------------------------------------------------
# name -> (lowest (excluded), highest (included) or None, what it is); the one declaration the CLI's flags
# (--target-pct, --mfu, --peak-tflops, --device-gib) and the notebooks' parameters are both checked against
QUANTITIES = {
    "target_pct": (0, None, "percent above uncompressed's best loss"),
    "mfu": (0, 1, "the fraction of the peak sustained while computing"),
    "peak_tflops": (0, None, ""),
    "device_gib": (0, None, "GiB of device memory"),
}


def check_quantity(quantity: str, value, label: str) -> None:
    """``value`` within :data:`QUANTITIES` ``[quantity]``, or a ``ConfigError``: '<label> <value> is invalid: ...'."""
    low, high, what = QUANTITIES[quantity]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and value > low and (high is None or value <= high):
        return
    rule = f"must be in ({low:g}, {high:g}]" if high is not None else f"must be a finite number > {low:g}"
    shown = f"{value:g}" if number else repr(value)
    sep = "" if label.endswith("=") else " "
    raise ConfigError(f"{label}{sep}{shown} is invalid: {rule}" + (f" ({what})" if what else ""))


# ---- typed conversion ---------------------------------------------------------------------------
_NONE_WORDS = ("none", "null", "~")
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def coerce(value, tp, name: str, from_string: bool = False):
    """``value`` as type ``tp`` (a field annotation), or ConfigError naming ``name``. ``from_string``: a command-line
    value, so "3" may be an int and "none" is None (for a string field, where "none" is a value, only "null")."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):                       # X | None
        (inner,) = [a for a in args if a is not type(None)]
        words = ("null",) if inner is str else _NONE_WORDS
        if value is None or (from_string and str(value).strip().lower() in words):
            return None
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
            with contextlib.suppress(ValueError):
                return int(str(value).strip())
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-3 (no dot) as a string: a float literal is accepted from YAML too
        if from_string or isinstance(value, str):
            with contextlib.suppress(ValueError):
                return float(str(value).strip())
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
    refuse(name, value, f"must be {_type_name(tp)}")


@functools.cache
def field_hints(cls) -> dict:
    """Field name -> resolved annotation of dataclass ``cls`` (cached: resolving string annotations compiles each one,
    and a config is built field by field: validating params.yaml's runs spent 90 % of its time here)."""
    return typing.get_type_hints(cls)


# ---- validation ---------------------------------------------------------------------------------
def check_fields(obj, where: str) -> None:
    """Type and range of every field of a (nested) config dataclass, from its annotations and metadata."""
    hints = field_hints(type(obj))
    for f in fields(obj):
        value, name = getattr(obj, f.name), f"{where}.{f.name}" if where else f.name
        if is_dataclass(value):
            check_fields(value, name)
            continue
        value = coerce(value, hints[f.name], name)
        if isinstance(value, float) and not math.isfinite(value):
            refuse(name, value, "must be a finite number")
        _check_range(name, value, f.metadata)


# metadata key -> (the test a value fails, what is allowed), checked in this order
_BOUNDS = {"min": (operator.lt, ">="), "min_exclusive": (operator.le, ">"), "max": (operator.gt, "<="),
           "max_exclusive": (operator.ge, "<")}


def _check_range(name: str, value, meta) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        refuse(name, value, f"allowed: {', '.join(repr(c) for c in meta['choices'])}")
    for key, (outside, allowed) in _BOUNDS.items():
        if key in meta and outside(value, meta[key]):
            refuse(name, value, f"must be {allowed} {meta[key]}")


# ---- building from dicts and dotted keys ---------------------------------------------------------
def build(cls, values: dict, where: str, from_string: bool = False):
    """A (nested) config dataclass from a dict; unknown keys and wrong types are refused."""
    if not isinstance(values, dict):
        refuse(where, values, f"must be a mapping of {cls.__name__} fields")
    hints = {f.name: field_hints(cls)[f.name] for f in fields(cls)}
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


def field_type(cls, key: str):
    """The annotation of a dotted ``key`` (``train.steps``: its first part names ``cls``), or ConfigError."""
    section, _, rest = key.partition(".")
    if not rest:
        raise ConfigError(f"{key!r} is a section: set one of its keys, e.g. {key}.{fields(cls)[0].name}=...")
    parts = rest.split(".")
    for i, part in enumerate(parts):
        hints = field_hints(cls)
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


def parse_set(items) -> dict[str, str]:
    """``["train.lr_muon=0.03", ...]`` -> {"train.lr_muon": "0.03"} (values stay strings until the type is known)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is invalid: expected SECTION.KEY=VALUE, e.g. --set train.lr_muon=0.03")
        out[key.strip()] = value
    return out


def set_nested(tree: dict, dotted: str, value) -> None:
    """``tree[a][b][c] = value`` for ``dotted`` ``"a.b.c"``, creating the sections on the way."""
    *path, last = dotted.split(".")
    for part in path:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted!r}: {part} is a value in the profile, not a section")
        tree = node
    tree[last] = value
