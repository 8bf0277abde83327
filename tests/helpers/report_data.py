"""Synthetic results for the report's tests: results dicts shaped like `mapl train`'s, the groups of a cpu profile,
the control studies' rows, frozen-trunk runs, held-out scores, and what a figure draws."""
import json

from mapl import report as R

D = 128          # d_model of the synthetic runs: uncompressed 2d = 256 bytes per token


DEFAULTS = {"none": (None, "none"), "int8": (None, "none"), "ssn": ("fixed-shared", "static"),
            "mapl": ("spel", "factorized"), "mapl-rvq": ("spel", "factorized")}


def result(method="none", ratio=1, seed=0, steps=300, loss=4.0, projector=None, anchor=None, stages=4, model="tiny",
           profile="cpu", eval_offset=0, name=None, overrides=None, d=D, sync="stream", lr_muon=0.02, lr_embed=0.03):
    """A results dict shaped like `mapl train`'s, with exact declared wire totals."""
    projector = projector or DEFAULTS[method][0]
    anchor = anchor or DEFAULTS[method][1]
    fwd = {"none": 2 * d, "int8": d + 2}.get(method, 2 * d / ratio / (2 if method == "mapl-rvq" else 1))
    bwd = fwd if method != "mapl-rvq" else 2 * d / ratio
    tokens, b = steps * 2048, stages - 1
    per_token = {"fwd": fwd, "bwd": bwd, "ids": 2 if projector else 0,
                 "state": 8 if projector in ("spel", "unconstrained") else 0,
                 "piggyback": (0.5 if sync == "stream" else 64) if method == "mapl-rvq" else 0}
    run = name or f"{model}-P{stages}-{method}-{ratio}x-{projector}-{anchor}-n{steps}-s{seed}"
    return {
        "run": run, "method": method, "model": model, "stages": stages, "ratio": 2 * d / fwd,
        "nominal_ratio": ratio, "projector": projector, "anchor": anchor, "steps": steps, "tokens": tokens,
        "val_loss": loss, "val_loss_curve": [[steps // 2, loss + 0.5], [steps, loss]],
        "train_loss_curve": [[i + 1, loss + 1.0 - i / steps] for i in range(steps)],
        "wire": {"fwd_bytes_per_token": fwd, "bwd_bytes_per_token": bwd, "id_bytes_per_token": per_token["ids"],
                 "uncompressed_bytes_per_token": 2 * d,
                 "declared": {k: v * tokens * b for k, v in per_token.items()}},
        "ortho_max_err": 1e-7 if projector == "spel" else None,
        "config": {"profile": profile, "model_overrides": overrides or {},
                   "compressor": {"rvq": {"sync": sync}, "spel": {"lr_mult": 0.1}},
                   "train": {"seed": seed, "eval_offset": eval_offset, "lr_muon": lr_muon, "lr_embed": lr_embed,
                             "lr_head": 0.01}},
        "provenance": {"seed": seed, "config_hash": f"{run}-{eval_offset}-{profile}"},
    }


LONG = {"none": [3.50, 3.52, 3.48], "ssn": [3.60, 3.63, 3.57], "mapl": [3.55, 3.56, 3.52],
        "fixed": [3.58, 3.58, 3.55], "rvq": [3.57, 3.59, 3.54]}


def write(base, group, res):
    path = base / group / f"{res['run']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res))


def results_groups():
    main = [result("none", loss=4.00), result("int8", loss=4.01), result("ssn", 4, loss=4.40),
            result("ssn", 8, loss=4.60), result("mapl", 4, loss=4.04), result("mapl", 8, loss=4.08),
            result("mapl-rvq", 4, loss=4.10), result("mapl-rvq", 8, loss=4.16)]
    abl = [result("mapl", 8, projector="fixed", loss=4.20, name="abl-fixed"),
           result("mapl", 8, projector="unconstrained", loss=4.30, name="abl-unc"),
           result("mapl", 8, anchor="none", loss=4.25, name="abl-anchor-none"),
           result("mapl", 8, anchor="static", loss=4.26, name="abl-anchor-static"),
           result("mapl", 8, anchor="full", loss=4.06, name="abl-anchor-full")]
    seeds = [result("none", seed=1, loss=4.02), result("mapl", 8, seed=1, loss=4.12),
             result("ssn", 8, seed=1, loss=4.62), result("mapl", 8, projector="fixed", seed=1, loss=4.22, name="abl-fixed-s1")]
    long, long_fixed, long_rvq = [], [], []   # three DVC groups, one study (params.yaml `groups:`)
    for s in range(3):
        long += [result("none", steps=3000, seed=s, loss=LONG["none"][s]),
                 result("ssn", 8, steps=3000, seed=s, loss=LONG["ssn"][s]),
                 result("mapl", 8, steps=3000, seed=s, loss=LONG["mapl"][s])]
        long_fixed += [result("mapl", 8, projector="fixed", steps=3000, seed=s, loss=LONG["fixed"][s],
                              name=f"long-fixed-s{s}")]
        long_rvq += [result("mapl-rvq", 8, steps=3000, seed=s, loss=LONG["rvq"][s])]
    tokens = [result(m, r, steps=1000, seed=s, loss=base + 0.01 * s)
              for s in range(2) for m, r, base in (("none", 1, 3.80), ("ssn", 8, 3.95), ("mapl", 8, 3.90))]
    width = [result(m, r, d=64, loss=lo, overrides={"d_model": 64}, name=f"w64-{m}")
             for m, r, lo in (("none", 1, 4.5), ("ssn", 8, 4.8), ("mapl", 8, 4.7))]
    rvq_sync = [result("mapl-rvq", 8, sync="full", loss=4.15, name="rvq-full"),
                result("mapl-rvq", 8, sync="mirrored", loss=4.14, name="rvq-mirrored")]
    tune = [result("mapl", 8, loss=4.4, eval_offset=65536, lr_muon=0.02, lr_embed=0.03, name="tune-mapl-a"),
            result("mapl", 8, loss=4.5, eval_offset=65536, lr_muon=0.04, lr_embed=0.03, name="tune-mapl-b"),
            result("none", loss=4.3, eval_offset=65536, lr_muon=0.02, lr_embed=0.03, name="tune-none-a")]
    return {"main": main, "ablations": abl, "seeds": seeds, "long": long, "long_rvq": long_rvq, "long_fixed": long_fixed,
            "tokens": tokens,
            "width": width,
            "rvq_sync": rvq_sync, "tune": tune}


def mini_rows(rows):
    """blocks' shape: another model's none, SSN and MAPL at 8x, at a budget of its own."""
    return [{**r, "model": "mini", "run": "mini-" + r["run"], "steps": 1000} for r in rows
            if (r["variant"] == "none" or r["variant"] in ("ssn", "mapl") and r["projection_ratio"] == 8) and r["steps"] == 300]


def figure_texts(fig) -> str:
    """Every string drawn on a figure: titles, axis labels, legend entries and titles, annotations."""
    out = [fig.get_suptitle(), fig.get_supylabel() if fig._supylabel else ""]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_title(loc="left"), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.texts]
    for leg in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        out += [t.get_text() for t in leg.get_texts()] + [leg.get_title().get_text()]
    return "\n".join(out)


def boxes_overlap(a, b) -> bool:
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 0.5 and min(a.y1, b.y1) - max(a.y0, b.y0) > 0.5


def health_run(variant, wire, seed, peak=50.0, warn=None):
    readings = [{"step": s, "boundaries": [{"train_max": peak * s / 300 + b} for b in range(3)]} for s in range(50, 301, 50)]
    method = next(m for m in ("mapl-rvq", "mapl", "ssn", "int8", "none") if variant.startswith(m))
    return {"variant": variant, "method": method, "wire_ratio": wire, "projection_ratio": None if method == "none" else wire,
            "model": "tiny", "stages": 4, "steps": 300, "seed": seed, "run": f"{variant}-{wire}-s{seed}",
            "health_readings": readings, "first_warning_step": warn}


def study_row(group, method, ratio=1, seed=0, loss=3.5, steps=3000, source="", name=None, **kw):
    row = R.row_from_result(result(method, ratio, seed=seed, steps=steps, loss=loss, name=name, **kw), group)
    return {**row, "data_source": source}


def study_rows():
    rows = []
    for s, none in enumerate([3.50, 3.52, 3.48]):
        ssn, mapl = none + 0.10 + 0.001 * s, none + 0.05
        rows += [study_row("long", "none", seed=s, loss=none), study_row("long", "ssn", 8, seed=s, loss=ssn),
                 study_row("long", "mapl", 8, seed=s, loss=mapl),
                 study_row("decompose", "ssn", 8, seed=s, loss=none + 0.08 + 0.002 * s, anchor="factorized"),
                 study_row("decompose", "ssn", 8, seed=s, loss=none + 0.075, anchor="factorized", overrides={"ffn_hidden": 724},
                            name=f"wide-s{s}"),
                 study_row("decompose", "mapl", 8, seed=s, loss=mapl + 0.01 * s, projector="fixed-shared"),
                 study_row("decompose", "none", seed=s, loss=none - 0.01, anchor="factorized", name=f"none-anchor-s{s}"),
                 study_row("learned_fixed_4x", "mapl", 4, seed=s, loss=mapl - 0.02),
                 study_row("learned_fixed_4x", "mapl", 4, seed=s, loss=mapl - 0.01 + 0.005 * s, projector="fixed"),
                 study_row("corpus", "none", seed=s, loss=1.20 + 0.01 * s, source="sympy-code", name=f"code-none-s{s}"),
                 study_row("corpus", "ssn", 8, seed=s, loss=1.26 + 0.01 * s, source="sympy-code", name=f"code-ssn-s{s}"),
                 study_row("corpus", "mapl", 8, seed=s, loss=1.23 + 0.01 * s, source="sympy-code", name=f"code-mapl-s{s}")]
    for s in range(2):
        rows += [study_row("blocks", "none", seed=s, steps=1000, loss=3.9, model="mini"),
                 study_row("blocks", "ssn", 8, seed=s, steps=1000, loss=4.0 + 0.01 * s, model="mini"),
                 study_row("blocks", "mapl", 8, seed=s, steps=1000, loss=3.95, model="mini"),
                 study_row("blocks", "ssn", 8, seed=s, steps=1000, loss=4.1, model="mini", stages=8),
                 study_row("blocks", "mapl", 8, seed=s, steps=1000, loss=4.0, model="mini", stages=8)]
    return rows


def scaled_rvq_row(group, ratio, seed, loss):
    res = result("mapl-rvq", ratio, seed=seed, steps=3000, loss=loss)
    res["config"]["compressor"]["rvq"]["scale"] = "token"
    return {**R.row_from_result(res, group), "data_source": ""}


def frozen_run(seed: int, projector: str, loss: float, trunk: float = 3.9) -> dict:
    return {"run": f"frozen-x-{projector}-s{seed}", "projector": projector, "ratio": 4.0, "seed": seed, "steps": 300,
            "trainable_params": 100, "val_before": 5.0, "val_loss": loss, "val_loss_curve": [[150, loss + 0.1], [300, loss]],
            "delta_pct": 100 * (loss - trunk) / trunk, "trunk": {"run": f"t-s{seed}", "steps": 1000, "val_loss": trunk},
            "override": {"compressor.projector.lr_mult": 0.3} if projector == "spel" else {}}


def rescored(rows, shift):
    """Scores of the headline's runs: each run's validation loss plus ``shift(row)``."""
    return {r["run"]: {"val_loss": r["val_loss"], "group": r["group"],
                       "scores": {"heldout-kjv": r["val_loss"] + shift(r)}} for r in rows if r["group"] == "long"}
