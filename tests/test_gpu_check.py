"""benchmarks/gpu_check.py --device cpu --small: the one-call GPU check's code path on CPU at micro shapes.

What the GPU call must get right without a second chance: every item on disk the moment it is measured,
a failed item recorded without costing the others, and numbers that mean what the README says."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


@pytest.mark.slow
def test_the_small_cpu_check_writes_every_item_as_measured(tmp_path):
    """The whole call as the GPU runs it (a child process; most of it the fused kernel's cold compile:
    30 s on an idle CPU, 3 minutes on a busy one)."""
    out = tmp_path / "check"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    every = json.loads((out / "check.json").read_text())["items"]
    for name in gpu_check.ITEMS:
        rec = json.loads((out / f"check-{name}.json").read_text())
        assert rec["ok"] and rec == every[name], name
    saved = every["saved-bytes"]
    assert saved["within_3pct"] and {r["precision"] for r in saved["rows"]} == {"fp32", "bf16"}
    rvq = every["rvq-kernel"]
    assert rvq["compile_s"] > 0 and rvq["plan_bytes"] > 0 and rvq["transient_bytes"] is None    # CUDA only
    reads = {r["method"]: r for r in every["host-reads"]["rows"]}
    assert set(reads) == set(gpu_check.METHODS)
    assert {"none", "int8", "ssn", "mapl"} <= set(every["host-reads"]["methods_without_reads"])
    errs = {r["method"]: r for r in every["boundary-error"]["rows"]}
    assert errs["none"]["fp32"] < 1e-2 and errs["mapl"]["fp32"] > 0


def test_saved_bytes_item_matches_the_plan_at_micro_shapes():
    got = gpu_check.saved_bytes(torch.device("cpu"), gpu_check._settings(True)["presets"], (16, 32))
    assert got["within_3pct"], got["rows"]
    assert [r["ratio"] for r in got["rows"] if r["precision"] == "fp32"] == [1.0]


def test_host_reads_are_counted_by_op():
    """The counter sees a scalar read, a data-dependent shape and nothing in plain arithmetic."""
    x = torch.arange(6.0)
    counts = []
    for fn in (lambda: float(x.sum()), lambda: x[x > 2], lambda: (x * 2 + 1).exp()):
        mode = gpu_check.HostReads()
        with mode:
            fn()
        counts.append(mode.total)
    assert counts[0] == 1 and counts[1] >= 1 and counts[2] == 0


@pytest.mark.slow
def test_host_reads_per_micro_batch_are_measured_per_method():
    """Issue 22 item 7, counted: no method reads the device per micro-batch but mapl-rvq's receiver, once per
    message (its header's ``tolist``: a device-to-host copy on CUDA, which the counter sees; on the CPU the
    tensor is already on the host, so it counts 0 there)."""
    got = gpu_check.host_reads(torch.device("cpu"), "micro", "micro", 256, (2, 32), micro_batches=2)
    rows = {r["method"]: r for r in got["rows"]}
    for m in ("none", "int8", "ssn", "mapl"):
        assert rows[m]["first"]["reads"] == rows[m]["later"]["reads"] == 0, rows[m]
    assert rows["mapl-rvq"]["first"]["reads"] <= 1 and rows["mapl-rvq"]["later"]["reads"] <= 1, rows["mapl-rvq"]


def test_a_failed_item_is_recorded_and_the_call_says_so(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(gpu_check, "boundary_error", boom)
    logs = []
    rc = gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path), "--items", "boundary-error"],
                        log=logs.append)
    rec = json.loads((tmp_path / "check-boundary-error.json").read_text())
    assert rc == 1 and not rec["ok"] and rec["error"] == "RuntimeError: out of memory"
    assert any("FAILED boundary-error" in line for line in logs)


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--items", "saved-bytes,speed"])
    assert e.value.code == 2 and "--items speed is invalid: allowed saved-bytes" in capsys.readouterr().err
