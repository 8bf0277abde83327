"""Train one run: build, train token-matched, evaluate, checkpoint/resume, write the results JSON.

Single process (the stages run in order in one process, every boundary through its wire)::

    python -m mapl.train --profile cpu --method mapl --ratio 8 --out reports/results/mapl-8x.json

The multi-process pipeline (one process per stage) is mapl/pipeline.py, launched with accelerate.
``--help`` documents every flag; profiles live in params.yaml and flags override them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import data as mdata
from .diagnostics import boundary_diagnostics
from .compress.base import StiefelParameter
from .config import METHODS, PROJECT_ROOT, ConfigError, RunConfig, config_hash, load_params, load_run_config, parse_set
from .stages import StagedModel, build_staged_model
from .wire import ByteMeter

__all__ = ["run", "build_optimizers", "lr_factor", "evaluate", "main", "resolve_data_dir", "atomic_write_json",
           "atomic_torch_save", "provenance"]


# ---- small utilities --------------------------------------------------------------------------
def atomic_write_json(path: Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:       # no git (e.g. an sdist): provenance says so rather than failing the run
        return ""


def provenance(cfg: RunConfig, data_hash: str) -> dict:
    return {"git_sha": _git("rev-parse", "HEAD") or None,
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "mapl")),
            "torch": torch.__version__, "python": platform.python_version(), "seed": cfg.train.seed,
            "config_hash": config_hash(cfg), "data_hash": data_hash, "host": platform.node()}


def resolve_data_dir(cfg: RunConfig) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir else PROJECT_ROOT / "data" / mdata.dataset_dir_name(cfg.data)


# ---- optimisation -----------------------------------------------------------------------------
def lr_factor(step: int, cfg) -> float:
    """Linear warmup, then linear decay to ``min_lr_frac`` of the peak at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return 1.0 - (1.0 - t.min_lr_frac) * frac


def _param_groups(sm: StagedModel, cfg: RunConfig) -> dict[str, list]:
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
    """The paper's recipe: Muon for 2-D hidden weights; AdamW for embeddings, head, norms, anchors;
    SPEL for Stiefel projectors. ``exclude``: ids of parameters some other process owns."""
    t, pc, spel = cfg.train, cfg.compressor.projector, cfg.compressor.spel
    groups = {k: [p for p in v if id(p) not in (exclude or set())] for k, v in _param_groups(sm, cfg).items()}
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
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["peak_lr"] * factor


def autocast_ctx(cfg: RunConfig, device: torch.device):
    p = cfg.train.precision
    use_bf16 = p == "bf16" or (p == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


@torch.no_grad()
def evaluate(sm: StagedModel, batches, cfg: RunConfig, device) -> float:
    was_training = sm.training
    sm.eval()                        # eval: compressors must not update state (RVQ EMA, k-means)
    total = 0.0
    with autocast_ctx(cfg, device):
        for x, y in batches:
            total += float(sm(x.to(device), y.to(device)))
    sm.train(was_training)
    return total / max(1, len(batches))


def _check_finite(loss: torch.Tensor, step: int, sm: StagedModel, ids: torch.Tensor) -> None:
    """One host sync per micro-batch (the loss is read for logging anyway); the culprit is searched
    only after a failure, so the hot path stays free of per-boundary checks."""
    if not torch.isfinite(loss):
        where = sm.find_nonfinite(ids) or "the loss only (activations finite)"
        raise FloatingPointError(f"non-finite training loss {float(loss.detach())} at step {step}; first non-finite "
                                 f"value: {where}. The last good checkpoint is kept; lower the LR or resume from it")


def _check_stiefel(sm: StagedModel, step: int) -> None:
    for p, comp in enumerate(sm.compressors()):
        for name, prm in comp.named_parameters():
            if not torch.isfinite(prm).all():
                raise FloatingPointError(f"non-finite projector {name} of boundary {p} (sender: stage {p}) after "
                                         f"the optimizer step of step {step}; the last good checkpoint is kept")


# ---- the run ----------------------------------------------------------------------------------
class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the end of the step and exits cleanly."""

    def __init__(self):
        self.stop = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:       # not the main thread (e.g. inside some notebook runners)
                pass
        return self

    def _handler(self, signum, frame):
        self.stop = True

    def __exit__(self, *exc):
        for sig, h in self._old.items():
            signal.signal(sig, h)


def _declared_bytes(sm: StagedModel, tokens_per_step: int, micro_batches: int, mb_shape, steps: int) -> dict:
    """Bytes the configuration says go on the wire for ``steps`` optimizer steps."""
    fwd = bwd = side = state = 0
    for comp in sm.compressors():
        fwd += comp.wire_bytes_per_token("fwd") * tokens_per_step
        bwd += comp.wire_bytes_per_token("bwd") * tokens_per_step
        side += micro_batches * comp.sync_bytes_per_microbatch()
        state += comp.sync_bytes_per_step() + comp.receiver_grad_bytes_per_step()
    ids = sm.id_bytes_per_token() * tokens_per_step * len(sm.compressors())
    out = {k: int(round(v * steps)) for k, v in dict(fwd=fwd, bwd=bwd, piggyback=side, state=state, ids=ids).items()}
    out["piggyback"] += sum(comp.one_off_sync_bytes() for comp in sm.compressors()) if steps else 0
    return out


def run(cfg: RunConfig, out: Path | None = None, ckpt: Path | None = None, progress: bool = True,
        log=print) -> dict:
    """Train ``cfg`` (single-process pipeline) and return the results dict (also written to ``out``)."""
    t0 = time.time()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    cfg.validate()                    # everything that does not depend on the tokenizer, before data is touched
    data_dir = resolve_data_dir(cfg)
    manifest = mdata.prepare(cfg.data, data_dir)
    vocab = int(manifest["vocab_size"])
    cfg = cfg.validate(vocab)
    train_tok = mdata.load_split(data_dir, "train")
    val_tok = mdata.load_split(data_dir, "val")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = cfg.train
    val_batches = mdata.eval_batches(val_tok[t.eval_offset:], t.eval_batch_size, t.seq_len, t.eval_tokens)

    sm = build_staged_model(cfg, vocab).to(device)
    opts = build_optimizers(sm, cfg)
    meter = ByteMeter()
    state = {"step": 0, "val_curve": [], "train_curve": [], "train_wall": 0.0}
    ckpt = Path(ckpt) if ckpt else None
    chash = config_hash(cfg)
    if ckpt and ckpt.exists():
        state = _load_checkpoint(ckpt, chash, sm, opts, meter)
        log(f"resumed {ckpt} at step {state['step']}")

    mb = t.batch_size // t.micro_batches
    bar = tqdm(total=t.steps, initial=state["step"], disable=not progress, desc=cfg.name(), leave=False)
    with _StopFlag() as flag:
        while state["step"] < t.steps:
            step = state["step"]
            ts = time.time()
            set_lr(opts, lr_factor(step, cfg))
            x, y = mdata.get_batch(train_tok, t.batch_size, t.seq_len, t.seed, step)
            x, y = x.to(device), y.to(device)
            loss_sum = 0.0
            for i in range(t.micro_batches):
                xs, ys = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
                with autocast_ctx(cfg, device):
                    loss = sm(xs, ys, meter) / t.micro_batches      # normalised explicitly: mean over micro-batches
                _check_finite(loss, step, sm, xs)
                loss.backward()
                loss_sum += float(loss.detach())
            for comp in sm.compressors():
                comp.fold_receiver_grad()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_([p for p in sm.parameters() if p.grad is not None], t.grad_clip)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            _check_stiefel(sm, step)
            _sync_boundaries(sm, meter)
            state["step"] = step + 1
            state["train_wall"] += time.time() - ts
            state["train_curve"].append([step + 1, loss_sum])
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            if state["step"] % t.eval_every == 0 or state["step"] == t.steps:
                vl = evaluate(sm, val_batches, cfg, device)
                if not math.isfinite(vl):
                    raise FloatingPointError(f"non-finite validation loss at step {state['step']}")
                state["val_curve"].append([state["step"], vl])
                log(f"{cfg.name()} step {state['step']}/{t.steps} train {loss_sum:.4f} val {vl:.4f}")
            if ckpt and (state["step"] % t.checkpoint_every == 0 or flag.stop):
                _save_checkpoint(ckpt, chash, sm, opts, meter, state)
            if flag.stop:
                log(f"interrupted at step {state['step']}: checkpoint written to {ckpt}; rerun the same command to resume")
                bar.close()
                raise KeyboardInterrupt(f"stopped by signal at step {state['step']}")
    bar.close()
    if ckpt:
        _save_checkpoint(ckpt, chash, sm, opts, meter, state)
    results = _results(cfg, sm, meter, state, manifest, time.time() - t0)
    # subspace diagnostics on <= 8192 held-out tokens (cheap; the same tokens for every method)
    n_seq = max(1, 8192 // t.seq_len)
    results["boundary_diagnostics"] = boundary_diagnostics(sm, [(x[:n_seq].to(device), y[:n_seq]) for x, y in val_batches[:1]])
    if out:
        atomic_write_json(out, results)
    return results


@torch.no_grad()
def _sync_boundaries(sm: StagedModel, meter: ByteMeter) -> None:
    """After the optimizer step: ship learned projectors to the receiver (a no-op in one process, where
    the receiver's copy is the same tensor, but metered so both runtimes report the same bytes)."""
    for p, comp in enumerate(sm.compressors()):
        payload = comp.sync_payload()
        if payload:
            comp.apply_sync(payload)
            meter.add(p, "fwd", "state", sum(v.numel() * v.element_size() for v in payload.values()))
        rg = comp.receiver_grad_bytes_per_step()
        if rg:
            meter.add(p, "bwd", "state", rg)


def _save_checkpoint(path, chash, sm, opts, meter, state):
    atomic_torch_save({"format": "mapl-checkpoint-v1", "config_hash": chash, "model": sm.state_dict(),
                       "optimizers": [o.state_dict() for o in opts], "meter": meter.state_dict(),
                       "state": state}, path)


def _load_checkpoint(path, chash, sm, opts, meter):
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} cannot be loaded safely (truncated, foreign, or needs pickled "
                         f"objects): {type(e).__name__}: {str(e)[:200]}. Delete it to start fresh.") from e
    if not isinstance(ck, dict) or ck.get("format") != "mapl-checkpoint-v1":
        raise ValueError(f"checkpoint {path} is not a mapl checkpoint (format mapl-checkpoint-v1)")
    if ck["config_hash"] != chash:
        raise ValueError(f"checkpoint {path} was written by another config (hash {ck['config_hash']}, this run "
                         f"{chash}); use another --ckpt path or delete it")
    sm.load_state_dict(ck["model"])
    for o, s in zip(opts, ck["optimizers"], strict=True):
        o.load_state_dict(s)
        for g in o.param_groups:
            g.setdefault("peak_lr", g["lr"])
    meter.load_state_dict(ck["meter"])
    return ck["state"]


def _results(cfg, sm, meter, state, manifest, wall) -> dict:
    t = cfg.train
    tokens_per_step = t.batch_size * t.seq_len
    steps = state["step"]
    mb_shape = (t.batch_size // t.micro_batches, t.seq_len)
    declared = _declared_bytes(sm, tokens_per_step, t.micro_batches, mb_shape, steps)
    measured = {"fwd": meter.total("data", "fwd"), "bwd": meter.total("data", "bwd"),
                "piggyback": meter.total("sync"), "state": meter.total("state"), "ids": meter.total("ids")}
    comps = sm.compressors()
    d = sm.model.cfg.d_model
    fwd_bpt = sum(c.wire_bytes_per_token("fwd") for c in comps) / max(1, len(comps))
    bwd_bpt = sum(c.wire_bytes_per_token("bwd") for c in comps) / max(1, len(comps))
    ortho = [c.diagnostics().get("ortho_err") for c in comps if "ortho_err" in c.diagnostics()]
    learned = [c for c in comps if c.learned]
    return {
        "run": cfg.name(), "method": cfg.compressor.method, "model": cfg.model, "stages": cfg.stages,
        "ratio": (2 * d / fwd_bpt) if comps else 1.0, "nominal_ratio": cfg.compressor.ratio,
        "projector": cfg.compressor.projector.kind, "anchor": cfg.compressor.anchor.kind,
        "steps": steps, "tokens": steps * tokens_per_step,
        "val_loss": state["val_curve"][-1][1] if state["val_curve"] else None,
        "val_loss_curve": state["val_curve"], "train_loss_curve": state["train_curve"],
        "wire": {"fwd_bytes_per_token": fwd_bpt, "bwd_bytes_per_token": bwd_bpt,
                 "id_bytes_per_token": sm.id_bytes_per_token(),
                 "uncompressed_bytes_per_token": 2 * d,
                 "sync_bytes_total": measured["state"] + measured["piggyback"],
                 "declared_bytes_total": sum(declared.values()), "measured_bytes_total": sum(measured.values()),
                 "declared": declared, "measured": measured, "per_boundary": meter.summary()},
        "ortho_max_err": max(ortho) if (ortho and learned) else None,
        "diagnostics": {str(p): c.diagnostics() for p, c in enumerate(comps)},
        "wall_s": wall, "train_wall_s": state["train_wall"],
        "tokens_per_s": steps * tokens_per_step / max(1e-9, state["train_wall"]),
        "n_params": sum(p.numel() for p in sm.parameters()),
        "unigram_entropy": manifest.get("splits", {}).get("val", {}).get("unigram_entropy"),
        "config": cfg.to_dict(),
        "provenance": provenance(cfg, manifest.get("splits", {}).get("train", {}).get("sha256", "")),
    }


# ---- CLI --------------------------------------------------------------------------------------
def parse_args(argv=None):
    params = load_params()
    ap = argparse.ArgumentParser(prog="python -m mapl.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=params.get("profile", "cpu"), choices=sorted(params.get("profiles", {})),
                    help="settings from params.yaml (default: %(default)s)")
    ap.add_argument("--model", help="model preset: micro, tiny, mini, 150M, 500M, 1B")
    ap.add_argument("--method", choices=sorted(METHODS), help="boundary compressor")
    ap.add_argument("--ratio", type=float, help="compression ratio d/r for projection methods (4, 8, 16, ...)")
    ap.add_argument("--projector", help="ablation: spel | fixed | unconstrained | fixed-shared")
    ap.add_argument("--anchor", help="ablation: none | static | full | factorized")
    ap.add_argument("--stages", type=int, help="pipeline stages P")
    ap.add_argument("--steps", type=int, help="optimizer steps")
    ap.add_argument("--seed", type=int, help="training seed (init and batch order)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other setting, e.g. --set train.lr_muon=0.03 --set compressor.rvq.rounds=4 (repeatable)")
    ap.add_argument("--out", type=Path, help="results JSON (default reports/results/<run>.json)")
    ap.add_argument("--ckpt", type=Path, help="checkpoint path (default checkpoints/<run>.pt); resumes if present")
    ap.add_argument("--fresh", action="store_true", help="ignore and overwrite an existing checkpoint")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return ap.parse_args(argv)


def config_from_args(args) -> RunConfig:
    """Flags and ``--set`` values, converted by each field's type (so errors name the field)."""
    over = {"model": args.model, "method": args.method, "ratio": args.ratio, "stages": args.stages,
            "projector": args.projector, "anchor": args.anchor, "train.steps": args.steps, "train.seed": args.seed}
    over = {k: (None if v is None else str(v)) for k, v in over.items()}
    over.update(parse_set(args.set))
    return load_run_config(args.profile, over, from_string=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
        out = args.out or PROJECT_ROOT / "reports" / "results" / f"{cfg.name()}.json"
        ckpt = args.ckpt or PROJECT_ROOT / "checkpoints" / f"{cfg.name()}.pt"
        if args.fresh and ckpt.exists():
            ckpt.unlink()
        res = run(cfg, out=out, ckpt=ckpt, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 130
    print(json.dumps({k: res[k] for k in ("run", "val_loss", "tokens", "tokens_per_s", "ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
