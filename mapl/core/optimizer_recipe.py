"""Which optimizer owns each parameter of a staged model, and the learning-rate scaling: shared by both engines
and the memory plan (a module of its own because the engine reads the memory plan)."""
from __future__ import annotations

import torch

from .compress.base import StiefelParameter
from .config import RunConfig
from .stages import StagedModel

__all__ = ["build_optimizers", "set_lr"]


def _param_groups(sm: StagedModel) -> dict[str, list]:
    groups = {k: [] for k in ("muon", "stiefel", "unconstrained", "embed", "head", "anchor", "other")}
    for name, p in sm.named_parameters():
        if not p.requires_grad:
            continue
        if isinstance(p, StiefelParameter):
            groups["stiefel"].append(p)
        elif name.startswith("boundaries."):         # a learned projector without the constraint (ablation)
            groups["unconstrained"].append(p)
        elif name.startswith("model.layers.") and p.ndim == 2:
            groups["muon"].append(p)
        elif name.startswith("model.tok_embeddings"):
            groups["embed"].append(p)
        elif name.startswith("model.output"):
            groups["head"].append(p)
        elif name.startswith("anchors."):
            groups["anchor"].append(p)
        else:
            groups["other"].append(p)
    return groups


def build_optimizers(sm: StagedModel, cfg: RunConfig, exclude: set[int] | None = None) -> list[torch.optim.Optimizer]:
    """The paper's recipe: Muon for 2-D hidden weights, AdamW for embeddings, head, norms and anchors, SPEL for
    Stiefel projectors. ``exclude``: ids of parameters another process owns."""
    t, pc, spel = cfg.train, cfg.compressor.projector, cfg.compressor.spel
    groups = {k: [p for p in v if id(p) not in (exclude or set())] for k, v in _param_groups(sm).items()}
    opts = []
    muon_params = groups["muon"] + (groups["unconstrained"] if pc.unconstrained_optimizer == "muon" else [])
    if muon_params:
        opts.append(torch.optim.Muon(muon_params, lr=t.lr_muon, weight_decay=t.weight_decay, momentum=t.muon_momentum))
    adam = [{"params": groups["embed"], "lr": t.lr_embed}, {"params": groups["head"], "lr": t.lr_head},
            {"params": groups["anchor"], "lr": t.lr_anchor or t.lr_embed}, {"params": groups["other"], "lr": t.lr_adam}]
    if pc.unconstrained_optimizer == "adamw":
        adam.append({"params": groups["unconstrained"], "lr": pc.lr_mult * t.lr_muon})
    adam = [g for g in adam if g["params"]]
    if adam:
        opts.append(torch.optim.AdamW(adam, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0))
    if groups["stiefel"]:
        from .optim import SPEL
        opts.append(SPEL(groups["stiefel"], lr=pc.lr_mult * t.lr_muon, momentum=spel.momentum,
                         polar=spel.polar, polar_steps=spel.polar_steps))
    for opt in opts:
        for g in opt.param_groups:
            g["peak_lr"] = g["lr"]
    return opts


def set_lr(opts, factor: float) -> None:
    """Every group's learning rate at ``factor`` times its peak."""
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["peak_lr"] * factor
