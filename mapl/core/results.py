"""The results JSON of one run (docs/architecture.md, "Results JSON"), built from plain data by both runtimes:
each boundary described once by its owner (``describe_boundary``), the byte meter, the loop state."""
from __future__ import annotations

import platform
import subprocess

import torch

from .config import PROJECT_ROOT, RunConfig, config_hash
from .wire import ByteMeter

__all__ = ["provenance", "describe_boundary", "declared_totals", "measured_totals", "build_results"]

_KINDS = ("fwd", "bwd", "piggyback", "state", "ids")


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:       # noqa: BLE001 -- no git (e.g. an sdist): provenance says so rather than failing
        return ""


def provenance(cfg: RunConfig, data_hash: str) -> dict:
    return {"git_sha": _git("rev-parse", "HEAD") or None,
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "mapl")),
            "torch": torch.__version__, "python": platform.python_version(), "seed": cfg.train.seed,
            "config_hash": config_hash(cfg), "data_hash": data_hash, "host": platform.node()}


def describe_boundary(comp, index: int, cfg: RunConfig, id_bytes_per_token: int, replicas: int = 1) -> dict:
    """Boundary ``index``'s declared bytes per token and per step (with R replicas, their sync and state count R
    times) and its diagnostics."""
    t = cfg.train
    tokens = t.batch_size * t.seq_len
    fwd_bpt, bwd_bpt = comp.wire_bytes_per_token("fwd"), comp.wire_bytes_per_token("bwd")
    per_step = {"fwd": fwd_bpt * tokens, "bwd": bwd_bpt * tokens,
                "piggyback": replicas * t.micro_batches * comp.sync_bytes_per_microbatch(),
                "state": replicas * (comp.sync_bytes_per_step() + comp.receiver_grad_bytes_per_step()),
                "ids": id_bytes_per_token * tokens}
    return {"boundary": index, "learned": bool(comp.learned), "fwd_bytes_per_token": fwd_bpt,
            "bwd_bytes_per_token": bwd_bpt, "declared_per_step": per_step,
            "declared_once": {"piggyback": replicas * comp.one_off_sync_bytes()}, "diagnostics": comp.diagnostics()}


def declared_totals(boundaries: list[dict], steps: int) -> dict:
    """Declared bytes of ``steps`` steps per kind, summed over boundaries, plus what is sent once per run."""
    once = {k: sum(b.get("declared_once", {}).get(k, 0) for b in boundaries) if steps else 0 for k in _KINDS}
    return {k: int(round(sum(b["declared_per_step"][k] for b in boundaries) * steps)) + once[k] for k in _KINDS}


def measured_totals(meter: ByteMeter) -> dict:
    return {"fwd": meter.total("data", "fwd"), "bwd": meter.total("data", "bwd"), "piggyback": meter.total("sync"),
            "state": meter.total("state"), "ids": meter.total("ids")}


def _wire(boundaries, meter, d_model, id_bytes, tokens, steps) -> dict:
    n = max(1, len(boundaries))
    declared, measured = declared_totals(boundaries, steps), measured_totals(meter)
    return {"fwd_bytes_per_token": sum(b["fwd_bytes_per_token"] for b in boundaries) / n,
            "bwd_bytes_per_token": sum(b["bwd_bytes_per_token"] for b in boundaries) / n,
            "id_bytes_per_token": id_bytes, "uncompressed_bytes_per_token": 2 * d_model,
            "sync_bytes_total": measured["state"] + measured["piggyback"],
            "declared_bytes_total": sum(declared.values()), "measured_bytes_total": sum(measured.values()),
            # everything that crossed a boundary (both directions, ids, projector exchange, codebook sync)
            # per training token and boundary: the number a link's bandwidth divides
            "total_bytes_per_token_per_boundary": sum(measured.values()) / max(1, tokens) / n if boundaries else 0.0,
            "declared": declared, "measured": measured, "per_boundary": meter.summary()}


def build_results(cfg: RunConfig, state, boundaries: list[dict], meter: ByteMeter, *, d_model: int,
                  id_bytes_per_token: int, n_params: int, manifest: dict, wall_s: float) -> dict:
    t = cfg.train
    tokens = state.step * t.batch_size * t.seq_len
    wire = _wire(boundaries, meter, d_model, id_bytes_per_token, tokens, state.step)
    ortho = [b["diagnostics"]["ortho_err"] for b in boundaries if "ortho_err" in b["diagnostics"]]
    learned = any(b["learned"] for b in boundaries)
    splits = manifest.get("splits", {})
    return {
        "run": cfg.name(), "method": cfg.compressor.method, "model": cfg.model, "stages": cfg.stages,
        "ratio": (2 * d_model / wire["fwd_bytes_per_token"]) if boundaries else 1.0,
        "nominal_ratio": cfg.compressor.ratio,
        "projector": cfg.compressor.projector.kind, "anchor": cfg.compressor.anchor.kind,
        "steps": state.step, "tokens": tokens,
        "val_loss": state.val_curve[-1][1] if state.val_curve else None,
        "val_loss_curve": state.val_curve, "train_loss_curve": state.train_curve,
        # the selection set (train.select_every): where a best step or a tuning winner is chosen
        "select_loss": state.select_curve[-1][1] if state.select_curve else None,
        "select_loss_curve": state.select_curve,
        "wire": wire,
        "ortho_max_err": max(ortho) if (ortho and learned) else None,
        "diagnostics": {str(b["boundary"]): b["diagnostics"] for b in boundaries},
        "wall_s": wall_s, "train_wall_s": state.train_wall,
        "tokens_per_s": tokens / max(1e-9, state.train_wall),
        "n_params": n_params,
        "unigram_entropy": splits.get("val", {}).get("unigram_entropy"),
        # the training split's size, so a table can state the epochs a run read without the data folder
        "train_split_tokens": splits.get("train", {}).get("tokens"),
        "resumed_with_changes": state.resumed_with_changes,
        # the early warning's trajectories: each boundary's max |z| / RMS (training and evaluation messages)
        # and, for RVQ, its codebooks, every train.health_every steps and at every evaluation
        "boundary_health": {"every": t.health_every, "warn_factor": t.health_warn_factor,
                            "readings": state.health, "warnings": state.health_warnings},
        "config": cfg.to_dict(),
        "provenance": provenance(cfg, splits.get("train", {}).get("sha256", "")),
    }
