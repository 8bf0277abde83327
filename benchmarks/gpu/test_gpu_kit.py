"""The GPU kit on a CPU: its help and refusals without CUDA, the plan it makes for 80 GB and 141 GB cards, and its
items at micro shapes, each written the moment it is measured."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent
ROOT = KIT.parents[1]
SCRIPT = KIT / "run.py"

import run  # noqa: E402 -- puts the repository and the kit's folder on sys.path
import measure  # noqa: E402


def _python(code: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **env})


@pytest.mark.process
def test_help_exits_0_on_a_machine_without_torch_or_cuda():
    blocked = "import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = sys.argv.pop(1); " \
              "runpy.run_path(sys.argv[0], run_name='__main__')"
    p = _python(blocked, str(SCRIPT), "--help", CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 0 and p.stdout.startswith("usage: python benchmarks/gpu/run.py"), p.stderr[-2000:]
    assert "--plan" in p.stdout and "reports/gpu/" in p.stdout


@pytest.mark.process
def test_without_cuda_a_run_is_one_error_line_and_exit_2():
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2 and p.stderr.startswith("error: no CUDA device here") and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    for argv, says in ((["--reps", "0"], "--reps 0 is invalid: must be >= 1"),
                       (["--card", "h100"], "--card plans for a card that is not here: use it with --plan"),
                       (["--card", "a100", "--plan"], "argument --card: invalid choice: 'a100'")):
        with pytest.raises(SystemExit) as stop:
            run.parse_args(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        run.main(["--cpu", "--items", "speed/2B"])
    assert stop.value.code == 2 and "--items speed/2B matches no item" in capsys.readouterr().err


@pytest.mark.slow
def test_the_1b_items_fit_80_and_141_gb_cards_and_are_skipped_on_a_24_gb_one():
    """Stage by stage, the 1B model at the paper's 16 x 2048-token micro-batches needs ~34 GiB (all four stages'
    activations at once would need ~75, more than an 80 GB card holds less its 10 % reserve)."""
    big = [it for it in run.items(False) if it["name"].startswith("speed/1B")]
    assert [it["name"] for it in big] == ["speed/1B/none/M32", "speed/1B/none/M64", "speed/1B/mapl/M32",
                                          "speed/1B/mapl/M64"]
    big = big[2:]                                     # MAPL's pair: the plans of 1B cost seconds each on a CPU
    h100, h200 = (run.card(run.parse_args(["--plan", "--card", c])) for c in ("h100", "h200"))
    assert (h100["memory_bytes"], h200["memory_bytes"]) == (80e9, 141e9)
    planned = run.plan(big, h100, False, {})
    need = {it["name"]: it["need_bytes"] / run.GIB for it in planned}
    assert 30 < need["speed/1B/mapl/M32"] < 40 and 20 < need["speed/1B/mapl/M64"] < need["speed/1B/mapl/M32"]
    assert not any(it["skip"] for it in planned) and not any(it["skip"] for it in run.plan(big, h200, False, {}))
    rtx = {"name": "24 GB card", "slug": "x", "memory_bytes": 24e9, "peak_flops": None}
    assert all("more than the card's 22.4 GiB" in it["skip"] for it in run.plan(big, rtx, False, {}))
    text = run.format_plan(planned, h100)
    minutes = int(re.search(r"expected wall time: about (\d+) min", text).group(1))
    assert minutes == -(-sum(it["expected_s"] for it in planned) // 60) and 2 <= minutes <= 10
    again = run.plan(big, h100, False, {"speed/1B/mapl/M32": 600.0})    # an earlier run's seconds on this card
    assert again[0]["expected_s"] == 600.0


def test_the_gpu_items_are_the_paper_runs_at_both_micro_batch_sizes():
    paper_chunk = run_config_chunk()
    for it in (it for it in run.items(False) if it["kind"] == "speed"):
        cfg = measure.speed_config(it["model"], it["method"], it["seqs"], False).validate(32000)
        t, mc = cfg.train, cfg.model_config(32000)
        assert (t.batch_size, t.seq_len, cfg.stages, t.schedule, t.precision) == (512, 2048, 4, "1f1b", "bf16")
        assert t.micro_batches == 512 // it["seqs"] and it["name"].endswith(f"/M{t.micro_batches}")
        assert cfg.compressor.rank(mc.d_model) == (mc.d_model if it["method"] in ("none", "int8") else 256)
        assert t.loss_chunk_tokens == paper_chunk > 0


def run_config_chunk() -> int:
    from mapl.core.config import load_run_config
    return load_run_config("paper", {}).train.loss_chunk_tokens


@pytest.mark.slow
def test_each_item_is_on_disk_when_measured_and_a_failed_one_costs_the_others_nothing(tmp_path, monkeypatch, capsys):
    """Micro shapes on a CPU: the half-size micro-batch's record beside the full-size one, each written before the
    next item starts; a simulated out-of-memory error recorded and the run going on to exit 1. What a stage keeps
    for its backward is the memory plan's per micro-batch term (within 3 %), and the FLOPs are the cost model's
    (a CPU's SDPA counts no attention) with the head's matmul run once more in the last stage's backward."""
    seen, speed = [], measure.speed

    def recording_speed(cfg, *a, **k):
        seen.append([r.get("item") for r in run.read_records(next(tmp_path.glob("*.jsonl")))])
        if cfg.compressor.method == "int8":
            raise RuntimeError("CUDA out of memory (simulated)")
        return speed(cfg, *a, **k)
    monkeypatch.setattr(measure, "speed", recording_speed)
    rc = run.main(["--cpu", "--out", str(tmp_path), "--reps", "1", "--items", "speed/micro/none,speed/micro/int8/M4"])
    recs = run.read_records(next(tmp_path.glob("*.jsonl")))
    assert rc == 1 and [r["kind"] for r in recs] == ["env", "speed", "speed", "error", "done"]
    assert seen == [[None], [None, "speed/micro/none/M4"], [None, "speed/micro/none/M4", "speed/micro/none/M8"]]
    assert recs[3]["error"] == "RuntimeError: CUDA out of memory (simulated)" and recs[-1]["errors"] == 1
    full, half = recs[1], recs[2]
    assert (full["micro_batches"], half["micro_batches"]) == (4, 8) and full["mfu"] > 0 and half["mfu"] > 0
    md = next(tmp_path.glob("*.md")).read_text()
    assert f"| speed/micro/none | {full['mfu']:.1%} (M = 4) | {half['mfu']:.1%} (M = 8) |" in md
    assert "`speed/micro/int8/M4`: error: RuntimeError" in md and "complete in" in md
    cfg = measure.speed_config("micro", "none", 2, True)
    mc, tokens, P = cfg.model_config(), 2 * cfg.train.seq_len, cfg.stages
    assert cfg.train.loss_chunk_tokens < tokens
    attention = 4 * cfg.train.seq_len * mc.n_heads * mc.head_dim * tokens * mc.n_layers // P
    recompute = [0] * (P - 1) + [2 * mc.d_model * mc.vocab_size * tokens]
    assert all(abs(r - 1) < 0.03 for r in full["saved_over_plan"]), full["saved_over_plan"]
    assert [f + attention for f in full["fwd_flops"]] == full["model_fwd_flops"]
    assert [b - 2 * f for b, f in zip(full["bwd_flops"], full["fwd_flops"])] == recompute
    assert [b + 2 * attention - r for b, r in zip(full["bwd_flops"], recompute)] == full["model_bwd_flops"]
    assert full["fwd_bytes"] == full["model_fwd_bytes"] and full["bwd_bytes"] == full["model_bwd_bytes"]
    links = full["links"]
    assert links["80Mbps"]["step_s"] >= links["200Mbps"]["step_s"] >= links["1Gbps"]["step_s"] > 0
    assert "expected wall time" in capsys.readouterr().out


def test_a_run_cut_off_keeps_its_records_and_says_so(tmp_path):
    path = tmp_path / "r.jsonl"
    run.write_record(path, "env", card="X", peak_flops=1e15, peak_source="datasheet")
    run.write_record(path, "skipped", item="speed/1B/none/M32", reason="needs 99.0 GiB")
    with open(path, "a") as f:
        f.write('{"kind": "speed", "item": "speed/1B/no')              # a torn last line
    md = run.summary(run.read_records(path))
    assert "**not finished**" in md and "`speed/1B/none/M32`: skipped: needs 99.0 GiB" in md


@pytest.mark.process
def test_the_kit_needs_nothing_beyond_torch_numpy_and_pyyaml(tmp_path):
    """Every other dependency the project declares is made unimportable; the kit still plans and measures."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ;]", d)[0].lower().replace("-", "_") for d in meta["dependencies"]}
    names |= {re.split(r"[<>=\[ ;]", d)[0].lower().replace("-", "_") for g in meta["optional-dependencies"].values()
              for d in g}
    blocked = sorted(names - {"torch", "numpy", "pyyaml"})
    assert {"datasets", "tokenizers", "tqdm", "matplotlib", "dvc", "papermill"} <= set(blocked)
    code = ("import runpy, sys\nfor n in sys.argv[2].split(','): sys.modules[n] = None\n"
            "sys.argv = [sys.argv[1], *sys.argv[3:]]\nrunpy.run_path(sys.argv[0], run_name='__main__')")
    p = _python(code, str(SCRIPT), ",".join(blocked), "--cpu", "--out", str(tmp_path), "--items", "ceiling")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["env", "ceiling", "done"]
