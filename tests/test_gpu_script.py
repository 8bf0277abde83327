"""benchmarks/gpu.py runs end to end on CPU with --dry (the same code path the H200 run takes)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry", "--out", str(tmp_path),
                           "--speed-steps", "2", "--quality-steps", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["method"] for r in out["speed"]] == ["none", "int8", "ssn", "mapl", "mapl-rvq"]
    assert [r["method"] for r in out["quality"]] == ["none", "ssn", "mapl", "mapl-rvq"]
    assert out["quality"][0]["delta_pct"] == 0.0
    assert all(r["tokens"] == out["quality"][0]["tokens"] for r in out["quality"]), "token-matched"
    assert "| mapl-rvq | 8x |" in (tmp_path / "gpu.md").read_text()
