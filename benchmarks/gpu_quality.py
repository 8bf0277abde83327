"""Part B of benchmarks/gpu.py: quality at the paper's width, token-matched, on a corpus that does not repeat.

none, ssn and mapl (r = 256, 4x) at the 150M shape (d = 1024, 8 layers, P = 4, single-process
pipeline: every boundary through its wire), bf16 autocast, 32 x 2048 tokens per step in two
16 x 2048 micro-batches. The three models train **round-robin**: step k of every method, then step
k + 1, each on the same batch (the "epochs" window order of part B's corpus: no window is read
twice), so whenever the time budget ends the three have trained on exactly the same tokens.

The plan is made once, after two calibration rounds inside the warm-up (whose learning rates do
not depend on the run length): steps = min(windows in the corpus / batch, time left / round time);
the LR schedule (warm-up, then linear decay to 10%) is then fixed for all three. Each finished step
writes one ``curve`` record (train losses; validation losses at each evaluation), so a run cut off
still leaves its curve. Every batch is fresh text, so the train loss is itself a held-out estimate.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from gpu_common import (autocast, build_model, digest, epoch_batch, free_device, lr_scale, run_config, set_lr,
                        sync, train_step)
from mapl.core import engine as mengine

__all__ = ["QUALITY_METHODS", "quality_config", "quality_shape", "run_quality"]

QUALITY_METHODS = (("none", 1.0), ("ssn", 4.0), ("mapl", 4.0))
CALIBRATION_ROUNDS = 2


def quality_shape(dry: bool) -> dict:
    if dry:
        return {"batch": 4, "seq_len": 32, "micro_batches": 2, "warmup": 2, "eval_seqs": 8, "model": "micro"}
    return {"batch": 32, "seq_len": 2048, "micro_batches": 2, "warmup": 20, "eval_seqs": 64, "model": "150M"}


def quality_config(method: str, ratio: float, dry: bool, steps: int):
    sh = quality_shape(dry)
    over = {"model": sh["model"], "stages": 4, "method": method, "ratio": ratio, "train.steps": steps,
            "train.batch_size": sh["batch"], "train.seq_len": sh["seq_len"], "train.micro_batches": sh["micro_batches"],
            "train.warmup_steps": sh["warmup"], "train.min_lr_frac": 0.1, "train.precision": "bf16",
            "train.schedule": "gpipe", "train.eval_batch_size": 16 if not dry else 4,
            "train.eval_tokens": sh["eval_seqs"] * sh["seq_len"]}
    return run_config("micro" if dry else "paper", over)


class _Run:
    """One method's model, optimizers and bookkeeping."""

    def __init__(self, method, ratio, dry, steps, vocab, device):
        self.method, self.ratio = method, ratio
        self.cfg = quality_config(method, ratio, dry, steps).validate(vocab)
        self.sm = build_model(self.cfg, vocab, device)
        self.opts = mengine.build_optimizers(self.sm, self.cfg)
        self.digest, self.steps, self.train_s, self.last_loss = "", 0, 0.0, None

    def set_steps(self, steps: int) -> None:
        self.cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, steps=steps))

    def step(self, k: int, x, y, device) -> float:
        t0 = time.perf_counter()
        set_lr(self.opts, lr_scale(k, self.cfg))
        loss = train_step(self.sm, self.opts, self.cfg, x, y, device)   # reads the loss: a device sync
        self.train_s += time.perf_counter() - t0
        self.digest = digest(x, seed=self.digest.encode())
        self.steps, self.last_loss = k + 1, loss
        return loss

    @torch.no_grad()
    def evaluate(self, val_batches, device) -> float:
        self.sm.eval()                   # eval: compressors must not update state (RVQ EMA, k-means)
        total = 0.0
        with autocast(self.cfg, device):
            for x, y in val_batches:
                total += float(self.sm(x.to(device), y.to(device)))
        self.sm.train()
        return total / max(1, len(val_batches))


def _val_batches(val, cfg):
    from mapl import data as mdata
    t = cfg.train
    return mdata.eval_batches(val, t.eval_batch_size, t.seq_len, t.eval_tokens)


def _round(runs, k, train, sh, device) -> tuple[dict, float]:
    x, y = epoch_batch(train, sh["batch"], sh["seq_len"], seed=0, step=k)
    x, y = x.to(device), y.to(device)
    t0 = time.perf_counter()
    losses = {r.method: r.step(k, x, y, device) for r in runs}
    return losses, time.perf_counter() - t0


def _evaluate_all(runs, val_batches, device) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = {r.method: r.evaluate(val_batches, device) for r in runs}
    sync(device)
    return out, time.perf_counter() - t0


def run_quality(ctx, train, val, budget, rec, max_steps: int | None = None) -> None:
    """Part B (see module docstring): writes quality_plan, curve (per step), quality (per method)."""
    dry, device, vocab = ctx["dry"], ctx["device"], ctx["vocab"]
    sh = quality_shape(dry)
    cap = ((len(train) - 1) // sh["seq_len"]) // sh["batch"]          # steps before any window would repeat
    if max_steps:
        cap = min(cap, max_steps)
    if cap < CALIBRATION_ROUNDS + 1:
        rec.write("skipped", item="quality", reason=f"corpus holds {cap} steps of {sh['batch']} x {sh['seq_len']}")
        return
    t0 = time.perf_counter()
    runs = [_Run(m, r, dry, cap, vocab, device) for m, r in QUALITY_METHODS]
    build_s = time.perf_counter() - t0
    val_batches = _val_batches(val, runs[0].cfg)
    tokens_per_step = sh["batch"] * sh["seq_len"]
    round_s = 0.0
    for k in range(CALIBRATION_ROUNDS):
        losses, round_s = _round(runs, k, train, sh, device)
        rec.write("curve", step=k + 1, tokens=(k + 1) * tokens_per_step, train_loss=losses, round_s=round_s)
    val_losses, eval_s = _evaluate_all(runs, val_batches, device)
    rec.write("curve", step=CALIBRATION_ROUNDS, tokens=CALIBRATION_ROUNDS * tokens_per_step, val_loss=val_losses)
    n_evals = 8
    room = budget.left() - ctx["final_reserve_s"] - n_evals * eval_s
    steps = max(CALIBRATION_ROUNDS, min(cap, CALIBRATION_ROUNDS + int(room / (1.1 * round_s))))
    for r in runs:
        r.set_steps(steps)
    eval_every = max(1, steps // n_evals)
    rec.write("quality_plan", steps=steps, corpus_steps=cap, tokens_per_step=tokens_per_step,
              tokens=steps * tokens_per_step, corpus_train_tokens=int(len(train)),
              corpus_fraction=steps * tokens_per_step / len(train), repeats=False, round_s=round_s, eval_s=eval_s,
              eval_every=eval_every, eval_tokens=sum(int(x.numel()) for x, _ in val_batches), build_s=build_s,
              methods=[{"method": m, "ratio": r} for m, r in QUALITY_METHODS], limited_by="corpus" if steps == cap
              else "time", warmup_steps=runs[0].cfg.train.warmup_steps, seq_len=sh["seq_len"],
              micro_batches=sh["micro_batches"], model=sh["model"])
    stopped = None
    for k in range(CALIBRATION_ROUNDS, steps):
        if budget.left() - ctx["final_reserve_s"] < 1.2 * round_s + eval_s:
            stopped = f"time budget: {budget.left():.0f} s left before step {k + 1}"
            break
        losses, round_s = _round(runs, k, train, sh, device)
        fields = {"step": k + 1, "tokens": (k + 1) * tokens_per_step, "train_loss": losses, "round_s": round_s}
        if (k + 1) % eval_every == 0 or k + 1 == steps:
            fields["val_loss"], eval_s = _evaluate_all(runs, val_batches, device)
        rec.write("curve", **fields)
    done = runs[0].steps
    if stopped:
        final, _ = _evaluate_all(runs, val_batches, device)
        rec.write("curve", step=done, tokens=done * tokens_per_step, val_loss=final)
        rec.write("quality_truncated", planned_steps=steps, steps=done, reason=stopped)
    for r in runs:
        rec.write("quality", method=r.method, ratio=r.ratio, steps=r.steps, tokens=r.steps * tokens_per_step,
                  batch_digest=r.digest, train_s=r.train_s,
                  tokens_per_s=r.steps * tokens_per_step / max(r.train_s, 1e-9),
                  last_train_loss=r.last_loss, rank=r.cfg.compressor.rank(r.sm.model.cfg.d_model))
    del runs
    free_device(device)

