"""The run groups as params.yaml's ``groups:`` declares them (each group's study and role; the roles are explained
there), in the report's order. Reads a params dict and nothing else, so the report, the orchestration and a
training run all reach it without importing each other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .settings import ConfigError, build, check_fields, setting

__all__ = ["ROLES", "APART_ROLES", "GroupDeclaration", "Declaration", "declaration"]

ROLES = ("reported", "tuning", "other-corpus", "redraw")
# the roles whose runs stand for no reported configuration (other learning rates, another draw): no report view
# pools them unless it asks for the tuning cells
APART_ROLES = ("tuning", "redraw")
NAME = re.compile(r"[a-z][a-z0-9_]*")        # a DVC stage item, a folder and a notebook name
WHERE = "groups"                             # the declaration's key in params.yaml
REQUIRED = ("study", "role")                 # every entry's keys; ``redraws`` only where the role is redraw


@dataclass(frozen=True)
class GroupDeclaration:
    """One group's entry: the study the report reads it into and how (:data:`ROLES`)."""
    study: str = setting("")
    role: str = setting("reported", choices=ROLES)
    redraws: str = setting("")           # role redraw only: the reported study whose runs this group draws again


@dataclass(frozen=True)
class Declaration:
    """Every declared group, in order (:func:`declaration` validates it)."""
    groups: dict[str, GroupDeclaration]

    def names(self) -> tuple[str, ...]:
        return tuple(self.groups)

    def study_of(self, group: str) -> str:
        """The study of ``group``; a folder no group declares (an ad-hoc run's) is a study of its own."""
        entry = self.groups.get(group)
        return entry.study if entry else group

    def studies(self) -> tuple[str, ...]:
        """Every study, in the order of its first group."""
        return tuple(dict.fromkeys(g.study for g in self.groups.values()))

    def groups_of(self, study: str) -> tuple[str, ...]:
        return tuple(name for name, g in self.groups.items() if g.study == study)

    def role_of_study(self, study: str) -> str:
        """The role the report reads ``study`` by: its groups'; ``reported`` for a study nothing declares."""
        roles = [g.role for g in self.groups.values() if g.study == study]
        return roles[0] if roles else "reported"

    def redrawn_study(self, study: str) -> str:
        """The reported study a ``redraw`` study's runs draw again ('' for any other study)."""
        return next((g.redraws for g in self.groups.values() if g.study == study and g.role == "redraw"), "")


def declaration(params: dict) -> Declaration:
    """params.yaml's ``groups:``, validated: every error is one line naming the field and what is allowed."""
    raw = params.get(WHERE)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"params.yaml `{WHERE}:` = {raw!r} is invalid: declare every run group once, as "
                          "`name: {study: ..., role: ...}`")
    groups = {_checked_name(name, f"{WHERE}: group name"): _entry(name, entry) for name, entry in raw.items()}
    _check_roles(groups)
    return Declaration(groups)


def _checked_name(name, what: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is invalid: lower-case letters, digits and _, starting with a letter")
    return name


def _entry(name: str, entry) -> GroupDeclaration:
    where = f"{WHERE}.{name}"
    missing = [k for k in REQUIRED if not isinstance(entry, dict) or k not in entry]
    if missing:
        raise ConfigError(f"{where} = {entry!r} is invalid: every group declares {' and '.join(REQUIRED)} "
                          f"(missing {', '.join(missing)})")
    decl = build(GroupDeclaration, entry, where)
    check_fields(decl, where)
    _checked_name(decl.study, f"{where}.study:")
    return decl


def _check_roles(groups: dict[str, GroupDeclaration]) -> None:
    """A study's groups share one role; a redraw names a reported study other than its own."""
    first_role: dict[str, tuple[str, str]] = {}
    for name, g in groups.items():
        other = first_role.setdefault(g.study, (g.role, name))
        if other[0] != g.role:
            raise ConfigError(f"{WHERE}.{name}.role={g.role!r} is invalid: study {g.study!r} is read as "
                              f"{other[0]!r} (group {other[1]}); a study's groups share one role")
    for name, g in groups.items():
        if (g.role == "redraw") != bool(g.redraws):
            raise ConfigError(f"{WHERE}.{name}.redraws={g.redraws!r} is invalid: a group of role 'redraw' names the "
                              "reported study it draws again, and only such a group does")
        if g.role == "redraw" and first_role.get(g.redraws, ("",))[0] != "reported":
            raise ConfigError(f"{WHERE}.{name}.redraws={g.redraws!r} is invalid: name a study of role 'reported' "
                              f"(declared: {', '.join(sorted(s for s, (r, _) in first_role.items() if r == 'reported'))})")
        if g.role == "redraw" and g.study == g.redraws:
            raise ConfigError(f"{WHERE}.{name}.study={g.study!r} is invalid: a redraw is a study of its own, never "
                              "pooled with the study it redraws")
