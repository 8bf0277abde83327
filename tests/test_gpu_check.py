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
def test_the_small_cpu_check_writes_every_item_as_measured_with_the_gpus_fused_search(tmp_path):
    """The whole call as the GPU runs it (a child process; most of it the fused kernel's cold compile:
    30 s on an idle CPU, 3 minutes on a busy one), with the RVQ search forced to the fused kernel that
    ``auto`` picks on a GPU: ``host-reads`` counts under a dispatch mode, where a ``fullgraph`` kernel
    cannot compile (the search falls back to matmul there), and ``boundary-error`` after it must still
    compile and run the fused kernel in the same process."""
    out = tmp_path / "check"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--out", str(out),
                        "--search-kernel", "fused"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    every = json.loads((out / "check.json").read_text())["items"]
    for name in gpu_check.ITEMS:
        rec = json.loads((out / f"check-{name}.json").read_text())
        assert rec["ok"] and rec == every[name], name
    saved = every["saved-bytes"]
    assert saved["within_3pct"] and {r["precision"] for r in saved["rows"]} == {"fp32", "bf16"}
    rvq = every["rvq-kernel"]
    assert rvq["compile_s"] > 0 and rvq["plan_bytes"] > 0 and rvq["transient_bytes"] is None    # CUDA only
    reads = every["host-reads"]
    assert reads["search_kernel"] == "fused" and {r["method"] for r in reads["rows"]} == set(gpu_check.METHODS)
    assert reads["methods_without_reads"] == list(gpu_check.METHODS), reads["rows"]
    errs = {r["method"]: r for r in every["boundary-error"]["rows"]}
    assert every["boundary-error"]["search_kernel"] == "fused"
    assert errs["none"]["fp32"] < 1e-2 and errs["mapl"]["fp32"] > 0 and errs["mapl-rvq"]["fp32"] > errs["mapl"]["fp32"]
    assert all(e["bf16_once"] == e["bf16"] for e in errs.values())          # the forward is the same bits


def test_saved_bytes_item_matches_the_plan_at_micro_shapes():
    got = gpu_check.saved_bytes(torch.device("cpu"), gpu_check._settings(True)["presets"], (16, 32))
    assert got["within_3pct"], got["rows"]
    assert [r["ratio"] for r in got["rows"] if r["precision"] == "fp32"] == [1.0]


def test_host_reads_are_counted_once_each_on_a_cpu_too():
    """The counter sees a scalar read, a data-dependent shape, the reads a CPU tensor makes without
    dispatching (tolist, numpy, numpy's __array__), each once, and nothing in plain arithmetic; the
    patched methods are restored afterwards."""
    x = torch.arange(6.0)
    cases = [(lambda: float(x.sum()), {"_local_scalar_dense": 1}), (lambda: x[x > 2], {"index[bool mask]": 1}),
             (lambda: x.tolist(), {"tolist": 1}), (lambda: x.numpy(), {"numpy": 1}),
             (lambda: __import__("numpy").asarray(x), {"__array__": 1}), (lambda: x[1].item(), {"item": 1}),
             (lambda: bool(x[1] > 0), {"__bool__": 1}), (lambda: (x * 2 + 1).exp(), {})]
    for fn, expected in cases:
        with gpu_check.counting_host_reads() as reads:
            fn()
        assert reads.counts == expected, (expected, reads.counts)
    assert "tolist" not in torch.Tensor.__dict__ and "__bool__" not in torch.Tensor.__dict__


@pytest.mark.slow
def test_host_reads_per_micro_batch_are_none_for_every_method(monkeypatch):
    """No method reads the device per training or evaluation micro-batch, mapl-rvq included (its receiver
    no longer reads the message header); counted on the CPU, where tolist of a CPU tensor dispatches
    nothing. The counter would see the header read the receiver used to make: put back, it is counted
    once per message."""
    cpu = torch.device("cpu")
    got = gpu_check.host_reads(cpu, "micro", "micro", 256, (2, 32), micro_batches=2)
    rows = {r["method"]: r for r in got["rows"]}
    for m in gpu_check.METHODS:
        assert rows[m]["first"]["reads"] == rows[m]["later"]["reads"] == rows[m]["eval"]["reads"] == 0, rows[m]
    from mapl.core.compress.rvq import RVQCompressor
    unpack = RVQCompressor.unpack

    def reading_unpack(self, payload, dtype):
        payload[1 + self._n_scales].tolist()              # what the receiver read per message before
        return unpack(self, payload, dtype)
    monkeypatch.setattr(RVQCompressor, "unpack", reading_unpack)
    monkeypatch.setattr(gpu_check, "METHODS", {"mapl-rvq": 4.0})
    (row,) = gpu_check.host_reads(cpu, "micro", "micro", 256, (2, 32), micro_batches=2)["rows"]
    assert row["later"]["by_op"] == row["eval"]["by_op"] == {"tolist": 1}


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


def test_jsonl_records_go_to_one_file_as_they_are_measured(tmp_path, monkeypatch):
    """``--jsonl``: one line per item the moment it is measured, a last line saying how the call ended, and
    no other file (a device call brings back a handful of files)."""
    monkeypatch.setattr(gpu_check, "saved_bytes", lambda *a: {"rows": [], "worst_rel_error": 0.0})

    def boom(*a, **k):
        lines = (tmp_path / "out" / "check.jsonl").read_text().splitlines()
        assert [json.loads(x)["item"] for x in lines] == ["saved-bytes"]      # on disk before the next item
        raise RuntimeError("out of memory")
    monkeypatch.setattr(gpu_check, "boundary_error", boom)
    rc = gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path / "unused"), "--items",
                         "saved-bytes,boundary-error", "--jsonl", str(tmp_path / "out" / "check.jsonl")],
                        log=lambda *_: None)
    recs = [json.loads(x) for x in (tmp_path / "out" / "check.jsonl").read_text().splitlines()]
    assert rc == 1 and [r["item"] for r in recs] == ["saved-bytes", "boundary-error", "done"]
    assert recs[0]["ok"] and not recs[1]["ok"] and recs[2]["ok"] is False
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["check.jsonl"]


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--items", "saved-bytes,speed"])
    assert e.value.code == 2 and "--items speed is invalid: allowed saved-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--device", "cpu", "--search-kernel", "triton"])
    assert e.value.code == 2 and "--search-kernel triton is invalid: allowed auto, matmul, fused" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--device", "cpu", "--shape", "2by32"])
    assert e.value.code == 2 and "--shape 2by32 is invalid: write sequences x tokens" in capsys.readouterr().err
    assert gpu_check.parse_args(["--device", "cpu", "--shape", "1x256"]).shape == (1, 256)
