"""The scale ladder's budget rule (params.yaml ``ladder:``), checked like any other setting of params.yaml."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..base.settings import ConfigError, build, check_fields, setting
from ..core.config import load_params
from ..core.model_config import PRESETS, count_params
from .groups import group_specs, spec_config

__all__ = ["LadderSettings", "ladder_settings", "ladder_steps", "check_ladder", "LADDER_GROUPS"]

LADDER_GROUPS = ("ladder_tune", "ladder")
_WHERE = "ladder"


@dataclass(frozen=True)
class LadderSettings:
    """params.yaml ``ladder:`` (see its comment there)."""
    tokens_per_param: float = setting(2.0, min_exclusive=0.0)
    rungs: tuple[str, ...] = field(default=())
    methods: tuple[str, ...] = field(default=("none", "ssn", "mapl"))
    ratio: float = setting(8.0, min_exclusive=1.0)
    stages: int = setting(4, min=2)
    seeds: tuple[int, ...] = field(default=(0, 1, 2, 3))
    primary: str = setting("")
    length_cells: tuple[dict, ...] = field(default=())     # {model, steps}: cells off the budget rule (size vs length)


def ladder_settings(params: dict | None = None) -> LadderSettings:
    """The validated ``ladder:`` block (its defaults where it is absent)."""
    params = params if params is not None else load_params()
    raw = params.get(_WHERE) or {}
    st = build(LadderSettings, raw, _WHERE)
    check_fields(st, _WHERE)
    unknown = [r for r in st.rungs if r not in PRESETS or not r.startswith("ladder-d")]
    if unknown:
        raise ConfigError(f"ladder.rungs={list(st.rungs)!r} is invalid: {unknown} are not ladder presets "
                          f"(allowed {sorted(k for k in PRESETS if k.startswith('ladder-d'))})")
    for i, cell in enumerate(st.length_cells):
        model, steps = cell.get("model"), cell.get("steps")
        if set(cell) != {"model", "steps"} or model not in PRESETS or not str(model).startswith("ladder-d") \
                or not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"ladder.length_cells[{i}]={cell!r} is invalid: a mapping {{model: <ladder preset>, "
                              "steps: <int >= 1>}")
    return st


def ladder_steps(model: str, tokens_per_param: float, tokens_per_step: int) -> int:
    """Steps that give ``model`` ``tokens_per_param`` training tokens per non-embedding parameter."""
    return round(tokens_per_param * count_params(PRESETS[model], include_embeddings=False) / tokens_per_step)


def check_ladder(profile: str, params: dict | None = None) -> int:
    """Every ladder run follows the budget rule (micro: only the sampling), on a named rung, read in ``epochs`` order."""
    params = params if params is not None else load_params()
    st = ladder_settings(params)
    checked = 0
    for group in LADDER_GROUPS:
        for spec in group_specs(profile, group, params):
            where = f"profiles.{profile}.runs.{spec['name']}"
            cfg = spec_config(profile, spec, params)
            if cfg.model not in st.rungs and profile != "micro":
                raise ConfigError(f"{where}: model={cfg.model!r} is not a rung of params.yaml ladder.rungs "
                                  f"{list(st.rungs)}")
            if cfg.data.sampling != "epochs":
                raise ConfigError(f"{where}: data.sampling={cfg.data.sampling!r} is invalid for the ladder: allowed "
                                  "'epochs' (no window may be read twice)")
            if profile != "micro":
                want = ladder_steps(cfg.model, st.tokens_per_param, cfg.train.batch_size * cfg.train.seq_len)
                if cfg.train.steps != want:
                    raise ConfigError(f"{where}: train.steps={cfg.train.steps} breaks the ladder's budget rule: "
                                      f"{st.tokens_per_param:g} tokens per non-embedding parameter on {cfg.model} is "
                                      f"{want} steps")
            checked += 1
    return checked
