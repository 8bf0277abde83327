"""When does learning the subspace pay? Boundaries inserted into a trained, frozen uncompressed model (issue 26).

Under joint training the stages can rotate what matters into whatever subspace they are given, so a
fixed random projector ties SPEL. Without co-adaptation they cannot: here the trunk (every weight of an
uncompressed model trained first) is frozen, MAPL's boundaries are inserted at every stage boundary,
and only the projectors A_p and the factorized anchors train. Three projectors per seed:

    spel             learned on the Stiefel manifold (SPEL), the paper's
    fixed            a random orthonormal basis per boundary, never trained (only the anchors train)
    unconstrained    learned without the constraint (Muon, the ablation's optimiser)

The trunk is the profile's uncompressed run: with ``--trunk-steps 3000`` on the cpu profile that is group
long's ``tiny-P4-none-3000steps-s<seed>``, read from ``checkpoints/cpu/`` when that checkpoint is complete
(read only), else trained once into ``checkpoints/<profile>/frozen-trunk/``. Each projector run takes the
mapl method's tuned settings (params.yaml method_overrides) with its own warm-up and decay over ``--steps``.
Writes ``reports/bench/frozen-trunk.json``: per seed the trunk's validation loss, and per projector the
validation loss before any step, its curve, the final loss and its penalty against the trunk.

    python benchmarks/frozen_trunk.py --profile cpu --trunk-steps 3000 --steps 300 --ratio 4 --seeds 0,1,2
    python benchmarks/frozen_trunk.py --profile micro --trunk-steps 20 --steps 10    # seconds
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.core.checkpoint import checkpoint_step, read as read_checkpoint
from mapl.core.config import PROJECTORS, ConfigError, RunConfig, config_hash, load_run_config
from mapl.core.engine import LocalEngine, build_optimizers
from mapl.base.io import atomic_write_json
from mapl.core.loop import lr_factor
from mapl.orchestration.sweep import run_name

STUDIED = ("spel", "fixed", "unconstrained")
TRAINABLE = ("boundaries.", "anchors.")          # what trains on the frozen trunk


def _budget(steps: int, eval_every: int) -> dict:
    return {"train.steps": steps, "train.warmup_steps": max(1, steps // 10), "train.eval_every": eval_every}


def trunk_config(profile: str, seed: int, steps: int, base: dict) -> RunConfig:
    """The uncompressed run the boundaries are inserted into (named as mapl.orchestration.sweep names it)."""
    every = max(1, steps // 4)
    if profile == "cpu" and steps == 3000:
        every = 250                                  # group long's cadence: the same config, so its checkpoint
    cfg = load_run_config(profile, {**base, "method": "none", "train.seed": seed, **_budget(steps, every)})
    return replace(cfg, run_name=run_name(cfg, load_run_config(profile, base).train.steps))


def trunk_state(cfg: RunConfig, ckpt_dir: Path, log=print) -> tuple[dict, str]:
    """The trained trunk's weights (``model.*``) and where they came from (``ckpt_dir``: the sweep's
    ``checkpoints/<profile>``, read only; a trunk trained here goes to its ``frozen-trunk/``)."""
    from mapl.core.run import run
    shared = ckpt_dir / f"{cfg.name()}.pt"
    private = ckpt_dir / "frozen-trunk" / f"{cfg.name()}.pt"
    for path in (shared, private):
        if path.exists():
            ck = read_checkpoint(path)
            if ck["config_hash"] == config_hash(cfg) and checkpoint_step(ck) >= cfg.train.steps:
                return {k: v for k, v in ck["model"].items() if k.startswith("model.")}, str(path)
    private.parent.mkdir(parents=True, exist_ok=True)
    log(f"training the trunk {cfg.name()} ({cfg.train.steps} steps) into {private}")
    run(cfg, ckpt=private, progress=False, log=lambda *a, **k: None)
    ck = read_checkpoint(private)
    return {k: v for k, v in ck["model"].items() if k.startswith("model.")}, str(private)


def frozen_engine(cfg: RunConfig, trunk: dict) -> LocalEngine:
    """``cfg``'s staged model with the trunk's weights loaded and frozen: only A_p and the anchors train."""
    eng = LocalEngine.build(cfg)
    missing, unexpected = eng.sm.load_state_dict(trunk, strict=False)
    if unexpected or any(not k.startswith(TRAINABLE) for k in missing):
        raise ValueError(f"the trunk does not fit {cfg.name()}: unexpected {unexpected[:3]}, missing "
                         f"{[k for k in missing if not k.startswith(TRAINABLE)][:3]} (the trunk must be method none "
                         "of the same model)")
    for name, p in eng.sm.named_parameters():
        p.requires_grad_(name.startswith(TRAINABLE))
    eng.opts = build_optimizers(eng.sm, cfg)         # only what requires grad
    return eng


def train_frozen(cfg: RunConfig, trunk: dict) -> dict:
    eng = frozen_engine(cfg, trunk)
    t = cfg.train
    before = eng.evaluate(0).val
    train_curve, val_curve, t0 = [], [], time.time()
    for step in range(t.steps):
        out = eng.train_step(step, lr_factor(step, cfg))
        if not math.isfinite(out.loss):
            raise FloatingPointError(f"{cfg.name()}: non-finite loss at step {step} ({out.nonfinite_at})")
        train_curve.append([step, out.loss])
        if (step + 1) % t.eval_every == 0 or step + 1 == t.steps:
            val_curve.append([step + 1, eng.evaluate(step + 1).val])
    frozen = [k for k, v in trunk.items() if not torch.equal(eng.sm.state_dict()[k], v)]
    if frozen:
        raise AssertionError(f"{cfg.name()}: trunk weights changed during training: {frozen[:3]}")
    return {"run": cfg.name(), "projector": cfg.compressor.resolved().projector.kind,
            "ratio": cfg.compressor.ratio, "trainable_params": sum(p.numel() for p in eng.sm.parameters() if p.requires_grad),
            "val_before": before, "val_loss": val_curve[-1][1], "val_loss_curve": val_curve,
            "train_loss_curve": train_curve, "wall_s": round(time.time() - t0, 1)}


def study(profile: str = "micro", seeds=(0,), trunk_steps: int = 20, steps: int = 10, ratio: float = 4,
          projectors=STUDIED, base: dict | None = None, ckpt_dir: Path | None = None, log=print) -> dict:
    """``base``: overrides for every run (the tests point the data at a tiny corpus)."""
    base = dict(base or {})
    ckpt_dir = Path(ckpt_dir or ROOT / "checkpoints" / profile)
    bad = [p for p in projectors if p not in PROJECTORS]
    if bad:
        raise ConfigError(f"--projectors {bad} is invalid: allowed {list(PROJECTORS)}")
    out = {"profile": profile, "ratio": ratio, "trunk_steps": trunk_steps, "steps": steps, "seeds": {}}
    for seed in seeds:
        tcfg = trunk_config(profile, seed, trunk_steps, base)
        trunk, origin = trunk_state(tcfg, ckpt_dir, log)
        ref = frozen_engine(tcfg, trunk).evaluate(0).val       # the trunk itself, uncompressed
        row = {"trunk": {"run": tcfg.name(), "from": origin, "val_loss": ref}, "projectors": {}}
        for proj in projectors:
            every = max(1, steps // 10)
            cfg = load_run_config(profile, {**base, "method": "mapl", "ratio": ratio, "projector": proj,
                                            "train.seed": seed, **_budget(steps, every)})
            cfg = replace(cfg, run_name=f"frozen-{tcfg.name()}-mapl-{ratio:g}x-{proj}-{steps}steps")
            res = train_frozen(cfg, trunk)
            res["delta_pct"] = 100 * (res["val_loss"] - ref) / ref
            row["projectors"][proj] = res
            log(f"seed {seed} {proj:<13} val {res['val_before']:.4f} -> {res['val_loss']:.4f} "
                f"({res['delta_pct']:+.2f} % vs the trunk's {ref:.4f})")
        out["seeds"][str(seed)] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--seeds", default="0", help="comma-separated train seeds")
    ap.add_argument("--trunk-steps", type=int, default=3000, help="the uncompressed trunk's budget")
    ap.add_argument("--steps", type=int, default=300, help="steps of A_p and anchor training on the frozen trunk")
    ap.add_argument("--ratio", type=float, default=4)
    ap.add_argument("--projectors", default=",".join(STUDIED))
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "frozen-trunk.json")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        res = study(args.profile, seeds, args.trunk_steps, args.steps, args.ratio, args.projectors.split(","))
    except (ValueError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
