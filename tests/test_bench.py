"""benchmarks/compress.py --quick on tiny shapes: the report has every section and the wire accounting holds."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the quick report measures peak memory in child interpreters (benchmarks/compress.py --_memory-child)
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("compress")


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = bench.main(["--quick", "--silent", "--memory-methods", "none", "mapl-rvq",
                      "--json", str(out / "compress.json"), "--md", str(out / "compress.md")])
    return res, out


def test_quick_report_has_every_section(bench, report):
    res, out = report
    data = json.loads((out / "compress.json").read_text())
    assert data == json.loads(json.dumps(res))
    for key in ("settings", "environment", "ops", "spel", "search", "stage", "overhead", "wire", "memory", "headline"):
        assert data[key], key
    env = data["environment"]
    assert env["threads"] == 1 and env["torch"] and env["cpu_model"]
    assert {o["method"] for o in data["ops"]} == set(bench.METHODS)
    for o in data["ops"]:
        for k in ("encode_fwd", "encode_bwd", "decode_fwd", "decode_bwd", "pack", "unpack", "pack_grad", "unpack_grad"):
            assert o[k] >= 0, (o["method"], k)
    for o in data["overhead"]:
        assert o["overhead_pct"] > 0 and o["stage_fwd_bwd_s"] > 0
    assert set(data["headline"]["overhead_pct"]) == set(bench.METHODS)
    assert {s["K"] for s in data["search"]} == {16, 256} and all(s["us_per_token"] > 0 for s in data["search"])
    assert all(s["svd"] > 0 and s["polar_express"] > 0 for s in data["spel"])
    assert {m["method"] for m in data["memory"]} == {"blocks-only", "none", "mapl-rvq"}
    assert all(m["peak_rss_mb"] > 0 and m["step_peak_increase_mb"] >= 0 for m in data["memory"])
    for o in data["overhead"]:
        assert o["overhead_pct_from_min"] > 0
    md = (out / "compress.md").read_text()
    assert "Wire efficiency" in md and "Overhead per micro-batch" in md


def test_wire_efficiency_is_full_or_explained(report):
    data = report[0]
    for w in data["wire"]:
        for eff in ("efficiency", "efficiency_fwd", "efficiency_bwd"):
            assert 0 < w[eff] <= 1 + 1e-12, (w["method"], eff)
            assert w[eff] >= 0.99 or w["explained_by"], (w["method"], eff, w[eff])
        # data bytes are exactly the declared size (no padding at these shapes) and match the floor
        assert w["declared_fwd_bytes_per_token"] == pytest.approx(w["fwd_floor_bytes_per_token"])
        assert w["fwd_bytes_per_token"] - w["fwd_sync_bytes_per_message"] / w["tokens_per_message"] \
            == pytest.approx(w["fwd_floor_bytes_per_token"])
    by = {w["method"]: w for w in data["wire"]}
    assert by["none"]["efficiency"] == 1.0 and by["int8"]["efficiency"] == 1.0
    assert by["mapl"]["efficiency"] == 1.0 and by["mapl"]["ids_bytes_per_token"] == 2.0
    assert by["mapl-rvq"]["fwd_sync_bytes_per_message"] > 0 and "sync" in by["mapl-rvq"]["explained_by"]


def test_baseline_comparison(bench, report, tmp_path):
    res, out = report
    again = bench.main(["--quick", "--silent", "--skip-memory", "--skip-stage", "--methods", "mapl-rvq",
                        "--baseline", str(out / "compress.json"),
                        "--json", str(tmp_path / "c.json"), "--md", str(tmp_path / "c.md")])
    b = again["baseline"]
    assert b["search"] and all(s["speedup"] > 0 for s in b["search"])
    assert b["ops"] and b["ops"][0]["pack"]["before"] > 0
    assert "Before / after" in (tmp_path / "c.md").read_text()


def _prepared(profile: str) -> bool:
    from mapl.core.config import load_run_config
    from mapl.core.engine import resolve_data_dir
    return (resolve_data_dir(load_run_config(profile)) / "manifest.json").exists()


def _script(args: list[str], tmp: Path) -> dict:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, *args, "--out-json", str(tmp / "b.json"), "--out-md", str(tmp / "b.md")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp / "b.json").read_text())


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.full          # a benchmark script over pipeline launches; make test runs the runtime itself
def test_costmodel_benchmark_runs_micro_cells_on_the_runtime(tmp_path):
    """benchmarks/costmodel.py reads the runtime's results (pipeline section of mapl.core.runtime.measure)."""
    if not _prepared("micro"):
        pytest.skip("micro data not prepared (mapl data --profile micro)")
    bench = _script(["benchmarks/costmodel.py", "--profile", "micro", "--widths", "64", "--bandwidths", "10e6",
                     "--latencies-ms", "1", "--mapl-width", "64", "--mapl-ratio", "4", "--seq-len", "32", "--steps", "3"],
                    tmp_path)
    assert [c["method"] for c in bench["cells"]] == ["none", "mapl"]
    for c in bench["cells"]:
        assert c["wire_bytes_match_meter"] and c["measured_step_s"] > 0 and c["runtime_clock_step_s"] > 0


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.full          # a benchmark script over pipeline launches; make test runs the runtime itself
def test_memory_benchmark_hooks_the_runtime_stage_build(tmp_path):
    """benchmarks/memory.py measures each rank around PipelineEngine._build_model (mapl.core.runtime.worker)."""
    if not (ROOT / "data" / "shakespeare-bpe2048" / "manifest.json").exists():
        pytest.skip("cpu data not prepared (mapl data --profile cpu)")
    bench = _script(["benchmarks/memory.py", "--model", "micro", "--stages", "2", "--cases", "1f1b:mapl", "--steps", "2",
                     "--seq-len", "32", "--micro-batches", "2", "--micro-batch-size", "1"], tmp_path)
    (case,) = bench["cases"]
    assert bench["model"] == "micro" and len(case["stages"]) == 2
    assert all(s["measured_train_peak"] > 0 and s["measured_setup_peak"] > 0 for s in case["stages"])


def test_slow_link_benchmark_models_the_planner_against_1f1b(tmp_path):
    """benchmarks/slow_link.py --quick (model part): on every link the planner's schedule is never slower than
    1F1B and never faster than the floor; on the slow links it is a deep warm-up."""
    bench = _script(["benchmarks/slow_link.py", "--quick"], tmp_path)
    rows = bench["model"]
    assert {r["method"].split()[0] for r in rows} == {"none", "ssn", "mapl", "mapl-rvq"}
    for r in rows:
        assert 1.0 <= r["planner_over_floor"] <= r["one_f_one_b_over_floor"] + 1e-12
    slow = [r for r in rows if r["link"] == "80Mbps"]
    assert slow and all(r["planner_schedule"].startswith("1f1b-x") for r in slow)
    assert "| planner / floor |" in (tmp_path / "b.md").read_text()
    # the int8 backward message: MAPL+VQ's floor falls (its bf16 backward is the busiest channel); MAPL's does not
    # (its forward, with the anchors' token ids, is at least as busy as either backward)
    by = {(r["method"], r["link"]): r for r in rows}
    int8 = {m.split()[0]: by[(m, "80Mbps")] for m, _ in by if m.endswith(", int8 backward")}
    bf16 = {m.split()[0]: r for (m, link), r in by.items() if link == "80Mbps" and "int8" not in m}
    assert sorted(int8) == ["mapl", "mapl-rvq"]
    assert int8["mapl-rvq"]["floor_s"] < bf16["mapl-rvq"]["floor_s"]
    assert int8["mapl"]["floor_s"] == bf16["mapl"]["floor_s"]
    assert all(int8[m]["compute_s"] == bf16[m]["compute_s"] for m in int8)


def test_slow_link_keep_measured_carries_the_measured_part_or_refuses(tmp_path):
    """--keep-measured reruns the model and carries the measured rows over as measured (a row that kept its run's
    measurement predicted again by the current model); with nothing measured in --out-json it is refused in one
    line (exit 2), and the file is left as it was."""
    import subprocess
    import sys
    out = tmp_path / "b.json"
    old_row = {"method": "mapl", "message_to_compute": 1.5, "link": "1Mbps", "schedule": "1f1b",
               "measured_step_s": 2.0, "predicted_step_s": 1.9, "error": -0.05, "floor_s": 1.0, "measured_over_floor": 2.0}
    over = {"method": "mapl", "ratio": 8, "stages": 4, "model.d_model": 64, "model.ffn_hidden": 192, "model.n_layers": 8,
            "train.batch_size": 8, "train.micro_batches": 4, "train.seq_len": 64, "train.schedule": "1f1b"}
    timing = {"fwd_s": [[0.01] * 4] * 4, "bwd_s": [[0.02] * 4] * 4, "opt_s": [0.05] * 4}
    kept_row = {**old_row, "micro_batches": 4, "bandwidth_bps": 1e6, "latency_s": 0.001, "overrides": over,
                "timing": timing}
    measured = {"message_to_compute": {"mapl": 1.5}, "measured_setup": {"runtime": "r", "width": 64, "micro_batches": 4,
                "micro_batch_size": 2, "seq_len": 64, "steps": 2, "latency_ms": 1.0},
                "measured": [old_row, kept_row], "load_before": "1.00", "load_after": "2.00"}
    out.write_text(json.dumps({"model": [], **measured}))
    bench = _script(["benchmarks/slow_link.py", "--quick", "--keep-measured"], tmp_path)
    assert {k: bench[k] for k in measured if k != "measured"} == {k: v for k, v in measured.items() if k != "measured"}
    assert bench["measured_kept_from"] == str(out) and bench["model"]
    assert bench["measured"][0] == old_row                      # no measurement kept: its prediction stays
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from slow_link import predicted
    new_row = bench["measured"][1]
    assert new_row == predicted(kept_row, "cpu") and new_row["predicted_step_s"] != 1.9
    assert new_row["predicted_one_step_s"] >= new_row["predicted_step_s"] > new_row["floor_s"] > 0
    # a row measured before the M column: the set-up's M; before the one-step column: dashes
    assert "| mapl | 1.50 | 1Mbps | 1f1b | 4 | 2.000 | 1.900 | -5.0% | – | – |" in (tmp_path / "b.md").read_text()
    out.write_text(json.dumps({"model": []}))
    r = subprocess.run([sys.executable, "benchmarks/slow_link.py", "--quick", "--keep-measured", "--out-json", str(out),
                        "--out-md", str(tmp_path / "c.md")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "holds no measured part" in r.stderr, r.stderr
    assert json.loads(out.read_text()) == {"model": []} and not (tmp_path / "c.md").exists()


def test_slow_link_host_work_is_the_untimed_rest_of_the_step_spread_over_each_stage_operations(monkeypatch):
    """A stage's host work is its step wall time less its compute, step-end compute and waits; the model with host
    work adds it to the stage's forwards and backwards evenly; none of it predicts the plain model's step."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from run_shape import host_work, with_host_work
    from slow_link import predicted
    pipe = {"step_wall_s": 1.0, "stage_compute_s_per_step": [0.5, 0.6], "stage_opt_s_per_step": [0.1, 0.1],
            "stage_wait_s_per_step": [0.3, 0.2]}
    assert host_work(pipe) == pytest.approx([0.1, 0.1])
    timing = {"fwd_s": [[0.01] * 4] * 4, "bwd_s": [[0.02] * 4] * 4, "opt_s": [0.05] * 4}
    hosted = with_host_work(timing, [0.08, 0.0, 0.0, 0.16])
    assert hosted["fwd_s"][0] == pytest.approx([0.02] * 4) and hosted["bwd_s"][3] == pytest.approx([0.04] * 4)
    assert hosted["fwd_s"][1] == timing["fwd_s"][1] and timing["fwd_s"][0] == [0.01] * 4     # the input is kept
    over = {"method": "mapl", "ratio": 8, "stages": 4, "model.d_model": 64, "model.ffn_hidden": 192, "model.n_layers": 8,
            "train.batch_size": 8, "train.micro_batches": 4, "train.seq_len": 64, "train.schedule": "1f1b"}
    row = {"method": "mapl", "link": "1Mbps", "bandwidth_bps": 1e6, "latency_s": 0.001, "measured_step_s": 2.0,
           "overrides": over, "timing": timing}
    assert "predicted_with_host_s" not in predicted(row, "cpu")              # a row measured before host work
    none = predicted({**row, "stage_host_s_per_step": [0.0] * 4}, "cpu")
    assert none["predicted_with_host_s"] == pytest.approx(none["predicted_step_s"], rel=1e-12)
    some = predicted({**row, "stage_host_s_per_step": [0.2] * 4}, "cpu")
    assert some["predicted_with_host_s"] > some["predicted_step_s"] == none["predicted_step_s"]
    assert some["error_with_host"] == pytest.approx((some["predicted_with_host_s"] - 2.0) / 2.0)


@pytest.mark.slow
@pytest.mark.full          # pipeline launches on a real-delay link; the deep schedule's parity runs in make test
def test_slow_link_benchmark_measures_schedules_on_a_real_delay_link(tmp_path):
    if not (ROOT / "data" / "shakespeare-bpe2048" / "manifest.json").exists():
        pytest.skip("cpu data not prepared (mapl data --profile cpu)")
    bench = _script(["benchmarks/slow_link.py", "--quick", "--measure"], tmp_path)
    assert [(r["method"], r["schedule"]) for r in bench["measured"]] == [
        ("mapl", "1f1b"), ("mapl", "1f1b-x2"), ("mapl, int8 backward", "1f1b"), ("mapl, int8 backward", "1f1b-x2")]
    assert all(r["measured_step_s"] >= r["floor_s"] for r in bench["measured"])
    # the int8 twin runs on its bf16 twin's link (same forward message, same compute)
    assert len({r["message_to_compute"] for r in bench["measured"]}) == 1
    assert {r["micro_batches"] for r in bench["measured"]} == {4}          # --quick: the config's M only


def test_slow_link_refuses_a_micro_batch_factor_that_does_not_split_the_micro_batch(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "benchmarks/slow_link.py", "--measure", "--micro-factors", "1", "3",
                        "--out-json", str(tmp_path / "s.json"), "--out-md", str(tmp_path / "s.md")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--micro-factors 3 is invalid: must be >= 1 and divide --micro-batch-size 2" in r.stderr
    assert not (tmp_path / "s.json").exists()
    r = subprocess.run([sys.executable, "benchmarks/slow_link.py", "--measure", "--stages", "1",
                        "--out-json", str(tmp_path / "s.json"), "--out-md", str(tmp_path / "s.md")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--stages 1 is invalid: a pipeline needs at least 2" in r.stderr
    assert not (tmp_path / "s.json").exists()


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.full          # pipeline launches on a real-delay link
def test_slow_link_stages_control_measures_two_processes_and_leaves_the_model_figure_alone(tmp_path):
    if not (ROOT / "data" / "shakespeare-bpe2048" / "manifest.json").exists():
        pytest.skip("cpu data not prepared (mapl data --profile cpu)")
    bench = _script(["benchmarks/slow_link.py", "--quick", "--measure", "--stages", "2"], tmp_path)
    assert bench["measured_setup"]["stages"] == 2
    assert all(r["overrides"]["stages"] == 2 and len(r["timing"]["fwd_s"]) == 2 for r in bench["measured"])
    assert all(len(r["stage_host_s_per_step"]) == 2 for r in bench["measured"])
    assert "P = 2, d = 64, 4 layers" in (tmp_path / "b.md").read_text() and not (tmp_path / "b.png").exists()


@pytest.mark.slow
@pytest.mark.full          # P ranks in network namespaces over a shaped link (root and iproute2, else it skips)
def test_kernel_link_benchmark_runs_a_cell_or_says_why_not(tmp_path):
    if not (ROOT / "data" / "shakespeare-bpe2048" / "manifest.json").exists():
        pytest.skip("cpu data not prepared (mapl data --profile cpu)")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "benchmarks/kernel_link.py", "--quick", "--out-json", str(tmp_path / "k.json"),
                        "--out-md", str(tmp_path / "k.md")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    if "skipped:" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    (cell,) = json.loads((tmp_path / "k.json").read_text())["cells"]
    assert cell["method"] == "mapl" and cell["measured_step_s"] >= cell["floor_s"] > 0
    assert cell["predicted_one_step_s"] > 0 and len(cell["timing"]["fwd_s"]) == 4     # the run's own measurement kept
    assert "Traceback" not in r.stderr
    assert "| one step (s) | error |" in (tmp_path / "k.md").read_text()


def test_kernel_link_settings_are_parsed_and_stated_in_the_table(load_benchmark, monkeypatch):
    """`--set KEY=VALUE` reaches every cell's config and the table says so; a setting without `=` is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))          # its sibling run_shape
    kl = load_benchmark("kernel_link")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "benchmarks/kernel_link.py", "--set", "projector"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--set 'projector' is invalid: expected SECTION.KEY=VALUE" in r.stderr, r.stderr
    setup = {"stages": 4, "schedule": "1f1b", "width": 128, "micro_batches": 8, "micro_batch_size": 4, "seq_len": 128,
             "steps": 8, "settings": {"projector": "fixed"}}
    bench = {"setup": setup, "cells": [], "skipped": [], "load_before": "0", "load_after": "0",
             "max_abs_error_comm25": 0.05, "max_abs_error_goodput_comm25": 0.06}
    assert "Every cell with `projector=fixed`." in kl.markdown(bench)
    assert "Every cell with" not in kl.markdown({**bench, "setup": {**setup, "settings": {}}})
    old_cell = {"method": "mapl", "rate_bps": 2e6, "latency_s": 0.0, "measured_step_s": 1.5, "predicted_step_s": 1.6,
                "error": 1 / 15, "predicted_goodput_step_s": 1.65, "error_goodput": 0.1, "comm_fraction": 0.6}
    row = kl.markdown({**bench, "cells": [old_cell]}).splitlines()[-1]      # measured before the one-step column
    assert row.endswith("| – | – | 60% |"), row
    new_cell = {**old_cell, "predicted_one_step_s": 1.7, "error_one_step": 0.2}
    assert kl.markdown({**bench, "cells": [new_cell]}).splitlines()[-1].endswith("| 1.700 | +20.0% | 60% |")
