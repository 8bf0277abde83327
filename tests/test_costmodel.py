"""The step-time model (mapl.planning.costmodel) and the planner (mapl.planning.planner) on hand-checkable cases."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mapl.core.config import load_run_config
from mapl.planning.costmodel import (PLANNER_SCHEDULES, BoundaryBytes, Case, GPUSpec, StageCompute, _wall_clock,
                                     boundary_bytes, build_case, gpu_hours, stage_flops,
                                     with_schedule_variants)
from mapl.core.link import LinkProfile, StepMeasurement, simulate
from mapl.planning.planner import crossover_bandwidth, crossover_interval, ratio_from_penalty, ratio_key, steps_ratios
from mapl.core.stages import split_layers

MICRO = dict(d=64, q=64, kv=64, f=192, V=256)


def _micro(method="none", **kw):
    over = {"method": method, "stages": 2, **kw}
    if method not in ("none", "int8"):
        over["ratio"] = 4
    return load_run_config("micro", over).validate(256)


def test_flops_match_a_hand_count():
    cfg = _micro()
    t, d = cfg.train, MICRO["d"]
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    block = 2 * (d * MICRO["q"] + 2 * d * MICRO["kv"] + MICRO["q"] * d + 3 * d * MICRO["f"]) + 4 * t.seq_len * MICRO["q"]
    split = split_layers(cfg.model_config(256), 2)
    fl = stage_flops(cfg, 256)
    assert fl[0]["fwd"] == tokens * len(split[0]) * block
    assert fl[1]["fwd"] == tokens * (len(split[1]) * block + 2 * d * MICRO["V"])
    assert fl[1]["bwd"] == 2 * fl[1]["fwd"]
    ckpt = stage_flops(cfg, 256, checkpointing=True)
    assert ckpt[0]["bwd"] == 2 * fl[0]["fwd"] + tokens * len(split[0]) * block
    # Muon: 5 Newton-Schulz iterations of 4 m^2 n + 2 m^3 per owned m x n matrix (m <= n)
    def ns(m, n):
        return 5 * (4 * m * m * n + 2 * m ** 3)

    per_block = 4 * ns(64, 64) + 3 * ns(64, 192)
    assert fl[0]["opt"] == len(split[0]) * per_block


def test_projection_flops_counted_on_both_sides():
    none, mapl = stage_flops(_micro(), 256), stage_flops(_micro("mapl"), 256)
    t = _micro().train
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    r = 64 // 4
    assert mapl[0]["fwd"] - none[0]["fwd"] == tokens * 2 * 64 * r
    assert mapl[1]["fwd"] - none[1]["fwd"] == tokens * 2 * 64 * r


def test_wire_bytes_come_from_the_compressors():
    t = _micro().train
    B, T = t.batch_size // t.micro_batches, t.seq_len
    assert boundary_bytes(_micro(), 256) == [BoundaryBytes(B * T * 64 * 2, B * T * 64 * 2, 0, 0)]
    # mapl 4x: r = 16 bf16 values each way, int16 token ids forward, A (64 x 16 fp32) synced and its
    # receiver-side gradient sent back once per step
    assert boundary_bytes(_micro("mapl"), 256) == [BoundaryBytes(B * T * (16 * 2 + 2), B * T * 16 * 2, 64 * 16 * 4, 64 * 16 * 4)]
    ssn = boundary_bytes(_micro("ssn"), 256)[0]
    assert (ssn.fwd, ssn.bwd, ssn.state_fwd, ssn.state_bwd) == (B * T * (16 * 2 + 2), B * T * 16 * 2, 0, 0)


def _case(schedule, P, M, fwd, bwd, nbytes, opt=0.0, state=0.0):
    comp = StageCompute([[fwd] * M for _ in range(P)], [[bwd] * M for _ in range(P)], [opt] * P, "hand")
    return Case(schedule, comp, [BoundaryBytes(nbytes, nbytes, state, 0.0)] * (P - 1))


def test_step_time_hand_case():
    # P = 2, M = 1: F0 [0,1], message 0.5 s + 0.1 s -> F1 [1.6,2.6], B1 [2.6,4.6], gradient 0.6 s ->
    # B0 [5.2,7.2], all-reduce 2 x 0.1 s -> 7.4, optimizer 0.5 s -> 7.9, A synced forward 0.5 + 0.1 -> 8.5:
    # the first step. Back to back, stage 0 starts the next at 7.9 while A is on the wire; its forward
    # message waits for the channel until 8.9 (the F's own end), so the next step repeats: 7.9 a step
    link = LinkProfile("x", 1e9, 0.1)
    case = _case("gpipe", 2, 1, 1.0, 2.0, 62_500_000, opt=0.5, state=62_500_000)
    pred = case.predict(link)
    assert pred.step_s == pytest.approx(7.9)
    assert case.one_step_time(link) == pytest.approx(8.5)
    assert pred.compute_s == pytest.approx(6.5)
    assert pred.comm_fraction == pytest.approx(1 - 6.5 / 7.9)
    # GPipe, M = 2, bandwidth-bound: the second message waits for the first on the channel
    assert _case("gpipe", 2, 2, 0.1, 0.1, 125_000_000).step_time(LinkProfile("y", 1e9, 0.0)) == pytest.approx(
        0.1 + 1 + 1 + 0.1 + 0.1 + 1 + 1 + 0.1)


def test_duplex_and_runtime_clock_agree():
    cfg = _micro("mapl")
    case = build_case(cfg, gpu=GPUSpec("test", 1e12, 0.5), vocab_size=256)
    link = LinkProfile("z", 50e6, 0.02)
    from mapl.core.link import simulate
    from mapl.planning.costmodel import _link_measurement
    assert case.step_time(link) == simulate(_link_measurement(case), link).step_time


def test_gpu_hours_arithmetic():
    params = {"groups": {"g": {"study": "g", "role": "reported"}}, "profiles": {"x": {
        "model": "micro", "stages": 1, "data": {"source": "shakespeare", "tokenizer": "byte", "vocab_size": 256},
        "train": {"steps": 100, "batch_size": 4, "seq_len": 32, "micro_batches": 2, "eval_every": 50,
                  "eval_tokens": 128},
        "runs": {"r": {"group": "g", "method": "none"}}}}}
    gpu = GPUSpec("test", 1e12, 0.5)
    rep = gpu_hours("x", gpu, params=params, n_gpus=(1,))
    d, T, V = 64, 32, 256                # the profile's data.vocab_size
    block = 2 * (4 * d * d + 3 * d * 192) + 4 * T * 64
    tokens = 2 * T
    fwd = tokens * (4 * block + 2 * d * V)
    ns = 4 * (4 * 5 * (4 * 64 ** 3 + 2 * 64 ** 3) + 3 * 5 * (4 * 64 * 64 * 192 + 2 * 64 ** 3))
    step = (2 * 3 * fwd + ns) / 0.5e12
    evals = 2 * (128 / tokens) * fwd / 0.5e12
    (run,) = rep["runs"]
    assert run["step_s"] == pytest.approx(step)
    assert run["gpu_hours"] == pytest.approx((100 * step + evals) / 3600)
    assert rep["total_gpu_hours"] == pytest.approx(run["gpu_hours"])
    assert rep["wall_clock_h"][1]["ideal"] == pytest.approx(run["gpu_hours"])


def test_wall_clock_list_scheduling():
    runs = [{"stages": 4, "run_s": 10.0}, {"stages": 4, "run_s": 10.0}, {"stages": 8, "run_s": 5.0}]
    assert _wall_clock(runs, 8) == 15.0
    assert _wall_clock(runs, 64) == 10.0
    assert _wall_clock(runs, 4) == math.inf


def test_crossover_bandwidth():
    # a: 1 + 8/bw, b: 2 + 1/bw -> equal at bw = 7; a is faster above
    # a: 2 + 1/bw, b: 1 + 8/bw -> equal at bw = 7; a is faster below
    assert crossover_bandwidth(lambda b: 2 + 1 / b, lambda b: 1 + 8 / b, lo=1, hi=1e3) == pytest.approx(7, rel=1e-9)
    assert crossover_bandwidth(lambda b: 1.0, lambda b: 2.0, lo=1, hi=1e3) == math.inf
    assert crossover_bandwidth(lambda b: 2.0, lambda b: 1.0, lo=1, hi=1e3) == 0.0
    iv = crossover_interval(lambda b: 2 + 1 / b, (1, 1), lambda b: 1 + 8 / b, (1, 1), 0.0, lo=1, hi=1e3)
    assert iv["mid"] == pytest.approx(7) and iv["low"] == pytest.approx(7) and iv["high"] == pytest.approx(7)
    # 10% error either way: a x 1.1 vs b x 0.9 -> bw = 6.1/1.3; a x 0.9 vs b x 1.1 -> bw = 7.9/0.7
    iv = crossover_interval(lambda b: 2 + 1 / b, (1, 1), lambda b: 1 + 8 / b, (1, 1), 0.1, lo=1, hi=1e3)
    assert iv["low"] == pytest.approx(6.1 / 1.3) and iv["high"] == pytest.approx(7.9 / 0.7)


def test_ratio_from_penalty():
    assert ratio_from_penalty(0.0, 3e9) == 1.0
    reducible = 410.7 * 3e9 ** -0.28
    assert ratio_from_penalty(0.1, 3e9) == pytest.approx((1 + 0.1 / reducible) ** (1 / 0.28))
    assert ratio_from_penalty(-0.05, 3e9) < 1 < ratio_from_penalty(0.05, 3e9, "besiroglu")


def test_steps_ratios_pair_seeds_and_mark_censored():
    def run(method, seed, curve, steps=300):
        return {"run": f"{method}{seed}", "method": method, "variant": method, "wire_ratio": 1.0 if method == "none"
                else 8.0, "steps": steps, "seed": seed, "model": "tiny", "val_loss": curve[-1][1], "val_loss_curve": curve}
    runs = [run("none", 0, [[100, 4.0], [200, 3.06], [300, 3.0]]), run("mapl", 0, [[100, 4.0], [200, 3.5], [300, 3.06]]),
            run("none", 1, [[100, 4.0], [200, 3.06], [300, 3.0]]), run("mapl", 1, [[100, 4.0], [200, 3.5], [300, 3.2]])]
    (r,) = steps_ratios(runs, target_pct=2.0)
    assert r["seeds"] == 2 and r["censored"] == 1
    assert r["min"] == pytest.approx(1.5) and r["max"] == pytest.approx(1.5)     # seed 1: lower bound 300/200


@pytest.mark.slow
def test_bench_cases_reproduce_the_runtime_clock():
    """Compressor-declared bytes equal the benchmark's metered bytes, so the step times are the runtime's."""
    import json
    from pathlib import Path
    from mapl.core.link import step_time
    from mapl.planning.planner_views import bench_cases
    path = Path(__file__).resolve().parents[1] / "reports" / "bench" / "pipeline.json"
    if not path.exists():
        pytest.skip("no committed pipeline benchmark")
    cases = bench_cases(path, "cpu")
    link = LinkProfile("x", 30e6, 0.01)
    for e in json.loads(path.read_text())["methods"]:
        meas = StepMeasurement(**e["timing"])
        case = cases[ratio_key(e["method"], e["ratio"])]
        assert case.step_time(link) == pytest.approx(step_time(meas, link), rel=1e-12)


# ---- the planner's summaries and views (mapl.planning.planner, mapl.planning.planner_views) ---------------------------------
def _run(method, seed, curve, steps=300, variant=None, ratio=None):
    """A run as the report's row (mapl.report.rows), the fields the planner reads."""
    return {"run": f"{variant or method}-{steps}-s{seed}", "group": "", "method": method, "variant": variant or method,
            "wire_ratio": ratio or (1.0 if method == "none" else 8.0), "steps": steps, "seed": seed, "model": "tiny",
            "val_loss": curve[-1][1], "val_loss_curve": curve}


def _runs():
    dense = [[100, 4.0], [200, 3.06], [300, 3.0]]
    return [_run("none", 0, dense), _run("none", 1, dense),
            _run("mapl", 0, [[100, 4.0], [200, 3.5], [300, 3.06]]), _run("mapl", 1, [[100, 4.0], [200, 3.5], [300, 3.06]]),
            _run("mapl", 0, [[100, 4.0], [200, 3.5], [300, 3.2]], variant="mapl-fixed"),
            _run("none", 0, [[200, 3.06], [400, 2.9], [600, 2.85]], steps=600),
            _run("mapl", 0, [[200, 3.2], [400, 3.0], [600, 2.9]], steps=600)]


def test_steps_ratio_table_lengths_variants_and_trend():
    from mapl.planning.planner import ratio_trend, steps_ratio_table, steps_ratios, steps_report
    ratios = steps_ratios(_runs())
    by = {(r["variant"], r["budget"]): r for r in ratios}
    assert by[("mapl", 300)]["seeds"] == 2 and by[("mapl", 300)]["mean"] == pytest.approx(1.5)
    assert by[("mapl", 300)]["sd"] == pytest.approx(0.0) and by[("mapl", 300)]["per_seed"] == {0: 1.5, 1: 1.5}
    assert by[("mapl-fixed", 300)]["censored"] == 1 and by[("mapl", 600)]["seeds"] == 1
    table = steps_ratio_table(ratios)
    assert table.splitlines()[0] == "| method | 300 steps | 600 steps |"
    assert "| mapl-fixed 8x | >1.50 [1.50, 1.50], n=1 (1 censored) |  |" in table
    trend = {(t["variant"], t["step"]): t for t in ratio_trend(_runs())}
    # along the 600-step runs: uncompressed's loss at 200 (3.06) is reached by mapl at 340 (on its line 3.2 -> 3.0)
    assert trend[("mapl", 200)]["mean"] == pytest.approx(1.7) and trend[("mapl", 600)]["mean"] is None
    assert trend[("mapl-fixed", 300)]["budget"] == 300
    text = steps_report(_runs())
    assert "mapl 8x (600 steps): 200: 1.70, 400: 1.50, 600: never" in text
    assert steps_report([_run("mapl", 0, [[100, 3.0]])]).startswith("No run has an uncompressed run")


def test_time_to_target_rows_use_the_common_target_and_mean_curves():
    from mapl.planning.planner import common_target, time_to_target_rows
    runs = _runs()
    target, budget, seeds = common_target(runs)
    assert (budget, seeds) == (600, 1) and target == pytest.approx(2.85 * 1.02)
    runs += [_run("int8", 0, [[100, 4.0], [300, 3.0]], ratio=2.0)]
    cases = {("none", 1.0): _Lin(1.0, 0.0), ("mapl", 8.0): _Lin(0.5, 0.0), ("ssn", 8.0): _Lin(0.5, 0.0),
             ("int8", 2.0): _Lin(0.5, 0.0)}
    rows = {r["method"]: r for r in time_to_target_rows(runs, cases, [1e9])}
    assert rows["none"]["budget"] == 600 and rows["none"]["steps_to_target"] == pytest.approx(200 + 200 * (3.06 - target) / 0.16)
    assert rows["mapl"]["steps_to_target"] == pytest.approx(400 + 200 * (3.0 - target) / 0.1) and rows["mapl"]["seeds"] == 1
    assert rows["mapl"]["time_s"] == pytest.approx(0.5 * rows["mapl"]["steps_to_target"])
    assert rows["int8"]["budget"] == 300 and rows["int8"]["steps_to_target"] is None and rows["int8"]["time_s"] is None
    assert rows["ssn"]["budget"] is None and rows["ssn"]["time_s"] is None
    assert common_target([_run("mapl", 0, [[100, 3.0]])]) is None
    overfit = [_run("none", 0, [[300, 2.80], [600, 2.90]], steps=600)]      # best mid-way, then worse: overfits
    assert common_target(overfit)[0] == pytest.approx(2.80 * 1.02)


class _Lin:
    """A case whose step is compute + bytes / bandwidth + latency (what the planner needs of a Case)."""

    def __init__(self, compute: float, bits: float):
        self.compute, self.bits = compute, bits

    def step_time(self, link) -> float:
        return self.compute + self.bits / link.bandwidth_bps + link.latency_s

    def scaled(self, k: float) -> "_Lin":
        return _Lin(self.compute * k, self.bits)


def test_plan_crossovers_grid_and_empty_views():
    from mapl.planning.planner_views import bandwidth_text, crossover_table, plan
    cases = {"none": _Lin(1.0, 8e9), "mapl 8x": _Lin(1.2, 1e9), "ssn 8x": _Lin(1.0, 1e9)}
    steps = {"none": (100, 100), "mapl 8x": (100, 100), "ssn 8x": None}
    res = plan(cases, steps, [1e6, 1e7], [0.0, 0.05], 0.0, 0.0, rival="ssn 8x")
    # mapl is faster below 1.2 + 1e9/bw = 1 + 8e9/bw <=> bw = 7e9 / 0.2 = 35 Gbit/s
    c = res["crossovers"][("mapl 8x", "none")]
    assert c["mid"] == pytest.approx(35e9, rel=1e-6) and bandwidth_text(c["mid"]) == "35 Gbit/s"
    assert res["bandwidths"][-1] >= 3 * 35e9 and res["bandwidths"][:3] == [1e6, 1e7, 3e7]     # extended to span it
    assert len(res["grid"]["mapl 8x"]) == 2 and len(res["grid"]["mapl 8x"][0]) == len(res["bandwidths"])
    assert res["never"] == ["ssn 8x"] and not res["empty"]
    assert "| mapl 8x | none | 35 Gbit/s | 35 Gbit/s |" in crossover_table(res)
    fixed = plan(cases, steps, [1e6, 1e7], [0.0], 0.0, 0.0, fit_grid=False)
    assert fixed["bandwidths"] == [1e6, 1e7]
    # only the reference reaches the target: nothing to compare, said in one line
    alone = plan(cases, {"none": (100, 100), "mapl 8x": None}, [1e6], [0.0], 0.0, 0.1)
    assert alone["grid"] == {"none": [[1.0]]} and set(alone["empty"]) == {"heatmap", "crossovers"}
    assert crossover_table(alone).startswith("No crossover to show: no compressed method reaches the target.")
    gone = plan(cases, {"none": None, "mapl 8x": (1, 1)}, [1e6], [0.0], 0.0, 0.1)
    assert gone["empty"]["heatmap"] == "no speedup against none: none never reaches the target"
    assert plan(cases, {}, [1e6], [0.0], 0.0, 0.1)["empty"]["curve"] == "no method reaches the target"
    assert [bandwidth_text(x) for x in (math.inf, 0.0, 2.5e5, 44.8e6, 1.5e12)] == \
        ["every bandwidth", "none", "250 kbit/s", "44.8 Mbit/s", "1.5 Tbit/s"]


def test_figures_never_blank():
    pytest.importorskip("matplotlib")
    from mapl.planning.planner_views import curve_figure, heatmap_figure
    assert heatmap_figure({"none": [[1.0]]}, [1e6], [0.0]) is None
    assert curve_figure({}, [1e6], 0.1) is None
    fig = heatmap_figure({"none": [[1.0, 1.0]], "mapl": [[1.1, 0.9]]}, [1e6, 1e7], [0.0])
    assert fig is not None and fig.axes[0].collections[0].norm.vmax == pytest.approx(1.25)


def test_planner_and_report_apply_one_time_to_target_rule():
    """On the committed cpu results and step measurement, the planner's time to target (cost-model cases)
    and the report's (mapl.report.studies.ttt, the measurement on the link clock) give the same steps (one rule:
    its target and mean curves) and the same step times (the cost model replays the same measurement)."""
    from pathlib import Path
    from mapl import report
    from mapl.planning.planner import load_runs, main_model_runs, time_to_target_rows
    from mapl.planning.planner_views import bench_cases, bench_profile
    root = Path(__file__).resolve().parents[1]
    bench, results = root / "reports/bench/pipeline.json", root / "reports/cpu/results"
    if not results.is_dir() or bench_profile(bench) != "cpu":
        pytest.skip("no committed cpu results or cpu pipeline benchmark")
    rows = report.select(report.load_results("", results))        # as the planner loads them
    theirs = {(t["method"], t["wire_ratio"]): t for t in report.time_to_target_rows(
        rows, report.load_bench(bench, "cpu"), [1e8], target_pct=2.0)}
    mine = time_to_target_rows(main_model_runs(load_runs(results)), bench_cases(bench, "cpu"), [1e8])
    assert theirs and len(mine) == len(theirs)
    for t in mine:
        r = theirs[(t["method"], t["ratio"])]
        assert (t["budget"], t["seeds"], t["target"]) == (r["budget"], r["seeds"], r["target"])
        assert t["steps_to_target"] == r["steps_to_target"]
        assert t["step_s"] == pytest.approx(r["step_s"], rel=1e-9)


def test_measured_steps_take_each_methods_longest_budget_and_never_another_methods_variant():
    """The paper-scale prediction from our steps compares budgets alike: MAPL+RVQ's 3,000-step ratio comes
    from its per-token-scale runs (its default configuration ran 300 steps only), and MAPL's never from the
    fixed projector's runs, however long they are."""
    from mapl.planning.planner import steps_ratios
    from mapl.planning.planner_views import pick_measured
    dense = [[100, 4.0], [200, 3.06], [300, 3.0]]
    long_dense = [[200, 3.06], [400, 2.9], [600, 2.85]]
    runs = [_run("none", 0, dense), _run("mapl-rvq", 0, [[100, 4.0], [200, 3.0], [300, 2.9]]),
            _run("none", 0, long_dense, steps=600), _run("mapl", 0, [[200, 3.2], [400, 3.0], [600, 2.9]], steps=600),
            _run("mapl-rvq", 0, [[200, 3.3], [400, 3.1], [600, 2.95]], steps=600, variant="mapl-rvq-scaled"),
            _run("mapl", 0, [[200, 3.06], [400, 2.8], [600, 2.7]], steps=900, variant="mapl-fixed")]
    picked = pick_measured(steps_ratios(runs), [("none", 1.0), ("mapl", 8.0), ("mapl-rvq", 8.0), ("ssn", 8.0)])
    assert set(picked) == {("mapl", 8.0), ("mapl-rvq", 8.0)}
    assert (picked[("mapl", 8.0)]["variant"], picked[("mapl", 8.0)]["budget"]) == ("mapl", 600)
    assert (picked[("mapl-rvq", 8.0)]["variant"], picked[("mapl-rvq", 8.0)]["budget"]) == ("mapl-rvq-scaled", 600)
    # at equal budget the preferred variant wins over the default configuration
    runs.append(_run("mapl-rvq", 0, [[200, 3.06], [400, 2.9], [600, 2.85]], steps=600))
    assert pick_measured(steps_ratios(runs), [("mapl-rvq", 8.0)])[("mapl-rvq", 8.0)]["variant"] == "mapl-rvq-scaled"
    # a study at another projection ratio and the same budget (learned_fixed_4x) never stands for the method: the
    # runs are taken at the headline's projection ratio (measured_sources)
    from mapl.report.rows import at_projection_ratio
    from mapl.report.studies.headline import headline_ratio

    def at_headline_ratio(runs):
        return at_projection_ratio(runs, headline_ratio(runs))
    headline = [{**r, "group": "long", "projection_ratio": None if r["method"] == "none" else 8} for r in runs]
    study = {**_run("mapl", 0, [[200, 3.06], [400, 2.86], [600, 2.8]], steps=600, ratio=4.0),
             "group": "learned_fixed_4x", "projection_ratio": 4}
    for order in ([study, *headline], [*headline, study]):
        assert at_headline_ratio(order) == [r for r in order if r is not study]
        picked = pick_measured(steps_ratios(at_headline_ratio(order)), [("mapl", 8.0)])[("mapl", 8.0)]
        assert picked == pick_measured(steps_ratios(headline), [("mapl", 8.0)])[("mapl", 8.0)] and picked["ratio"] == 8.0
    assert pick_measured(steps_ratios([study, *headline]), [("mapl", 8.0)])[("mapl", 8.0)]["ratio"] == 4.0  # the bug


def test_uncompressed_with_anchors_is_never_the_planners_reference():
    """The control 'uncompressed + anchors' is method none; pairing against it would move every ratio."""
    from mapl.planning.planner import steps_ratios
    base = steps_ratios(_runs())
    control = _run("none", 0, [[100, 3.0], [200, 2.5], [300, 2.4]], variant="none-anchor-factorized")
    assert steps_ratios(_runs() + [control]) == base


# ---- the planner's schedules for slow links ------------------------------------------------------------------------
@pytest.mark.parametrize("P,M", [(2, 8), (4, 32), (8, 32)])
def test_twice_the_warm_up_meets_the_flush_bound_on_a_link_bound_step(P, M):
    """Compute free, every message one second: a synchronous step cannot beat M messages plus the first
    forward's P - 2 further hops down and the last gradient's P - 1 back (M + 2P - 3 s). 1f1b-x2 meets it;
    1F1B, holding at most P - s micro-batches, idles the link while it waits for gradients."""
    link = LinkProfile("1kB/s", 8e3, 0.0)
    bound = M + 2 * P - 3
    steps = {}
    for schedule in ("1f1b", "1f1b-x2", "1f1b-x3", "1f1b-x4", "gpipe"):
        meas = StepMeasurement.uniform(schedule, P, M, 0.0, 0.0, [1000] * (P - 1), [1000] * (P - 1), collective=False)
        steps[schedule] = simulate(meas, link).step_time
        assert steps[schedule] >= bound - 1e-9
    assert steps["1f1b-x2"] == pytest.approx(bound)
    assert steps["1f1b"] > bound + (P - 2) if P > 2 else steps["1f1b"] >= bound


def test_the_planner_takes_the_fastest_schedule_that_fits_memory():
    cfg = _micro("mapl", **{"stages": 4, "train.micro_batches": 8, "train.batch_size": 16, "train.schedule": "1f1b"})
    gpu = GPUSpec("test", 1e12, 0.5)
    case = build_case(cfg, gpu=gpu, vocab_size=256)
    roomy = with_schedule_variants(case, cfg, replace(gpu, memory_bytes=1e12), 256)
    assert sorted(v.label for v in roomy.variants) == sorted(
        [s for s in PLANNER_SCHEDULES if s != "1f1b"] + [f"{s} + checkpointing" for s in PLANNER_SCHEDULES])
    assert with_schedule_variants(case, cfg, replace(gpu, memory_bytes=1e6), 256).variants == ()   # nothing fits
    slow, fast = LinkProfile("slow", 1e5, 0.0), LinkProfile("fast", 1e12, 0.0)
    for link in (slow, fast):
        p = roomy.predict(link)
        every = [case.predict(link)] + [v.predict(link) for v in roomy.variants]
        assert p.step_s == min(q.step_s for q in every) and p.schedule in {q.schedule for q in every}
    assert roomy.predict(slow).schedule.startswith("1f1b-x") and roomy.predict(slow).step_s < case.predict(slow).step_s
    assert roomy.scaled(2.0).variants[0].compute.fwd_s[0][0] == 2 * roomy.variants[0].compute.fwd_s[0][0]


def test_the_planner_also_weighs_the_same_batch_in_more_micro_batches():
    """Factor 2: every schedule again at 2M micro-batches of half the size (a factor that does not divide the batch
    is skipped); their floor is the config's (the same bytes), and on a link-bound step the shorter fill and drain
    make the planner take them, labelled with their M."""
    cfg = _micro("mapl", **{"stages": 4, "train.micro_batches": 4, "train.batch_size": 16, "train.schedule": "1f1b"})
    gpu = GPUSpec("test", 1e12, 0.5, memory_bytes=1e12)
    case = build_case(cfg, gpu=gpu, vocab_size=256)
    both = with_schedule_variants(case, cfg, gpu, 256, micro_batch_factors=(1, 2, 3))     # 3 x 4 does not divide 16
    more = [v for v in both.variants if v.more_micro_batches]
    assert {v.micro_batches for v in more} == {8} and len(more) == 2 * len(PLANNER_SCHEDULES)
    assert all(v.label.endswith(", M = 8") for v in more)
    slow = LinkProfile("slow", 1e5, 0.0)
    best = both.predict(slow)
    assert best.schedule.endswith(", M = 8") and best.step_s < with_schedule_variants(case, cfg, gpu, 256).predict(slow).step_s
    assert best.floor_s == pytest.approx(case.predict(slow).floor_s)
