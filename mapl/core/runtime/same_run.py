"""Before any work, the ranks of one pipeline prove they were started for the same run: each built its config,
opened its data and runs its code on its own machine, and a difference would otherwise train silently or fail
as a shape error or timeout. Every rank gathers every fingerprint (config but :data:`LOCAL_FIELDS`, shared
options, data manifest, code) and all refuse, naming each differing rank and field, before anything is written.
"""
from __future__ import annotations

import hashlib
import json

from ..config import RunConfig, flatten_config

__all__ = ["LOCAL_FIELDS", "RunMismatch", "run_fingerprint", "data_fingerprint", "differences", "mismatch_message",
           "check_same_run"]

# per-machine settings that do not change what a rank computes with its peers
LOCAL_FIELDS = frozenset({"train.threads", "data_dir", "train.activation_checkpointing"})
_SHOWN = 6          # differing fields named per rank before "... and N more"


class RunMismatch(ValueError):
    """The ranks were started for different runs (config, options, data or code)."""


def data_fingerprint(cfg: RunConfig) -> str | None:
    """A hash of the prepared data's manifest (tokenizer and shard sha256s), or None without a readable one."""
    from ...data import read_manifest
    from ..engine import resolve_data_dir
    try:
        m = read_manifest(resolve_data_dir(cfg))
    except (ValueError, FileNotFoundError, OSError):
        return None
    ident = [m["tokenizer"]["sha256"], m["dtype"], *(m["splits"][s]["sha256"] for s in ("train", "val"))]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def run_fingerprint(cfg: RunConfig, options: dict) -> dict:
    """What this rank runs: ``config.<field>``, ``run.<option>``, ``data`` and ``code``."""
    from ..fingerprint import code_fingerprint
    config = {f"config.{k}": json.dumps(v, sort_keys=True, default=str)
              for k, v in flatten_config(cfg.to_dict()).items() if k not in LOCAL_FIELDS}
    return {**config, **{f"run.{k}": json.dumps(v, default=str) for k, v in sorted(options.items())},
            "data": data_fingerprint(cfg), "code": code_fingerprint()}


def _describe(key: str, value) -> str:
    if value is None:
        return "unreadable" if key == "data" else "unset"
    return value if key in ("data", "code") else str(value)


def differences(fingerprints: list[dict]) -> dict[int, list[str]]:
    """Rank -> the keys where its fingerprint differs from rank 0's (``data`` only where both have one)."""
    ref, out = fingerprints[0], {}
    for r, fp in enumerate(fingerprints[1:], 1):
        keys = [k for k in sorted(set(ref) | set(fp)) if ref.get(k) != fp.get(k)
                and not (k == "data" and None in (ref.get(k), fp.get(k)))]
        if keys:
            out[r] = keys
    return out


_KINDS = (("config.", "settings"), ("run.", "options"), ("data", "prepared data"), ("code", "training code"))


def mismatch_message(fingerprints: list[dict], diffs: dict[int, list[str]]) -> str:
    ref = fingerprints[0]
    kinds = [name for prefix, name in _KINDS if any(k.startswith(prefix) for keys in diffs.values() for k in keys)]
    per_rank = []
    for r, keys in diffs.items():
        named = ", ".join(f"{k.removeprefix('config.')} ({_describe(k, ref.get(k))} vs {_describe(k, fingerprints[r].get(k))})"
                          for k in keys[:_SHOWN])
        per_rank.append(f"rank {r} differs from rank 0 in {named}"
                        + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""))
    return (f"the ranks were started for different runs ({', '.join(kinds)} differ): " + "; ".join(per_rank)
            + ". Start every rank with the same command, params.yaml, prepared data and training code")


def check_same_run(fingerprint: dict, refusal: str | None = None) -> None:
    """Collective: raise :class:`RunMismatch` on every rank when any fingerprint differs, else any rank's
    ``refusal`` (rank 0's results guard) as a ValueError on every rank."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (fingerprint, refusal))
    diffs = differences([fp for fp, _ in everyone])
    if diffs:
        raise RunMismatch(mismatch_message([fp for fp, _ in everyone], diffs))
    refused = [(r, why) for r, (_, why) in enumerate(everyone) if why]
    if refused:
        raise ValueError("; ".join(why if r == 0 else f"rank {r}: {why}" for r, why in refused))
