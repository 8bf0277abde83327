"""Property-based fuzzing (hypothesis) of what a user types and what a run loads back.

- Every settings field (``--set SECTION.KEY=VALUE``) and every flag of the commands that end without training
  (``train`` and ``pipeline`` with the run itself stubbed, ``memory``, ``costmodel``, ``plan``), given random
  values: exit 0, or exit 2 with one ``error:`` line; never a traceback (exit 1).
- Random byte corruption of a checkpoint, a data manifest and a results JSON: a one-line refusal or, where the
  bytes changed nothing that is read, the same content; the corrupted file is never rewritten.

``make test`` draws a few examples per property; the ``full`` copies (``make test-all``) draw many more.
"""
from __future__ import annotations

import contextlib
import io
import os
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mapl.cli
import mapl.orchestration.launch
import mapl.orchestration.pipeline_launch
import mapl.orchestration.sweep
from mapl.core.config import RunConfig, flatten_config

FEW, MANY = 30, 400
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))

# values a user might type: numbers of every kind, words, empties, YAML's specials; no '/', so a value used as a
# path stays inside the test's folder
SPECIALS = ["", " ", "0", "-0", "1", "-1", "nan", "inf", "-inf", "1e309", "0x10", "1_000", "true", "false", "null",
            "none", "[]", "{}", "[1, 2]", "..", ".", "é", "3.5", "2**8", "'1'", "1 2", "--", "-", "=", "cpu", "cuda",
            "mapl", "ssn", "spel", "factorized", "gpipe", "1f1b", "bf16", "auto", "bpe", "byte"]
SAFE_TEXT = st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), max_size=12)
VALUES = st.one_of(st.sampled_from(SPECIALS), st.integers(-10**12, 10**12).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr), SAFE_TEXT)
SETTING_KEYS = sorted(flatten_config(RunConfig().to_dict()))


def fuzzed(**strategies):
    """A property ``body`` drawn from ``strategies``, twice: FEW examples (``make test``), MANY (``full``)."""
    def both(body):
        def drawn(n):
            return settings(FUZZ, max_examples=n)(given(**strategies)(body))
        return drawn(FEW), pytest.mark.slow(pytest.mark.full(drawn(MANY)))
    return both


def _run_cli(argv: list[str]) -> tuple[int, str]:
    """``mapl <argv>`` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = mapl.cli.main(argv)
        except SystemExit as e:             # argparse: --help 0, a usage error 2
            code = e.code if isinstance(e.code, int) else 2
    return code, err.getvalue()


def _assert_clean(argv: list[str], code: int, stderr: str) -> None:
    assert "Traceback" not in stderr and code in (0, 2), f"mapl {' '.join(argv)!r} -> exit {code}:\n{stderr}"
    if code == 2:
        errors = [line for line in stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, f"mapl {' '.join(argv)!r}: not one error line:\n{stderr}"


@pytest.fixture
def no_runs(monkeypatch, tmp_path):
    """Commands parse, validate and check their paths as usual, but nothing trains or launches; cwd is a temp folder."""
    monkeypatch.setattr(mapl.orchestration.sweep, "train_one", lambda *a, **k: None)
    monkeypatch.setattr(mapl.orchestration.pipeline_launch, "launch",
                        lambda *a, **k: mapl.orchestration.launch.LaunchResult([], 0, "", "", 0.0))
    for var in ("WORLD_SIZE", "RANK", "MAPL_RENDEZVOUS_TIMEOUT", "MAPL_PG_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _any_setting(no_runs, key, value):
    argv = ["train", "--profile", "micro", "--set", f"{key}={value}", "--out", "r.json", "--ckpt", "r.pt"]
    _assert_clean(argv, *_run_cli(argv))


test_every_setting_with_a_random_value_is_accepted_or_one_line, test_every_setting_with_a_random_value_many = \
    fuzzed(key=st.sampled_from([*SETTING_KEYS, "method", "ratio", "train", "magic.key", "train.magic"]),
           value=VALUES)(_any_setting)

FLAGS = {
    "train": ["--model", "--method", "--ratio", "--projector", "--anchor", "--stages", "--steps", "--seed", "--name",
              "--group", "--out", "--ckpt"],
    "pipeline": ["--model", "--method", "--ratio", "--stages", "--steps", "--seed", "--schedule", "--replicas",
                 "--timeout", "--rendezvous-timeout", "--link-delay", "--link-latency-ms", "--launcher"],
    "memory": ["--model", "--method", "--ratio", "--stages", "--schedule", "--micro-batches", "--seq-len", "--device",
               "--device-gib"],
    "costmodel": ["--groups", "--mfu", "--peak-tflops", "--out"],
    "plan": ["--target-pct", ""],
}
CASES = [(command, flag) for command, flags in FLAGS.items() for flag in flags]


def _any_flag(no_runs, case, value):
    command, flag = case
    argv = [command, "--profile", "micro"] if command not in ("plan",) else [command]
    if command in ("train", "pipeline") and flag not in ("--out", "--ckpt"):
        argv += ["--out", "r.json", "--ckpt", "r.pt"]
    argv += [f"{flag}={value}"] if flag else [value]       # "=": a value may start with '-'
    _assert_clean(argv, *_run_cli(argv))


test_every_flag_with_a_random_value_is_accepted_or_one_line, test_every_flag_with_a_random_value_many = \
    fuzzed(case=st.sampled_from(CASES), value=VALUES)(_any_flag)


# ---- corrupted files -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_corpus):
    """A 2-step micro run: its checkpoint, results JSON and the data folder it read."""
    from dataclasses import replace

    from mapl.core.config import load_run_config
    from mapl.core.run import run
    from mapl.data import DataConfig
    base = tmp_path_factory.mktemp("finished")
    cfg = replace(load_run_config("micro", {"method": "mapl", "ratio": 4, "train.steps": 2}),
                  data=DataConfig(source="text", paths=(str(tiny_corpus.parent / "doc*.txt"),), tokenizer="byte"),
                  data_dir=str(tiny_corpus))
    run(cfg, out=base / "main" / "r.json", ckpt=base / "r.pt", progress=False, log=lambda *a: None)
    return {"ckpt": base / "r.pt", "results": base / "main" / "r.json", "data": Path(tiny_corpus)}


def _corrupt(data: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, bit in flips:
        out[pos % len(out)] ^= 1 << bit
    return bytes(out[:cut % (len(out) + 1)] if cut is not None else out)


CORRUPTION = {"flips": st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 7)), min_size=1, max_size=4),
              "cut": st.none() | st.integers(0, 2**31)}


def _refused_or_same(load, path: Path, original, same) -> None:
    """``load(path)`` refuses in one line (a ValueError), or reads what ``same`` accepts; ``path`` stays as it was."""
    before = path.read_bytes()
    try:
        got = load(path)
    except ValueError as e:             # names the file, or the folder's file its manifest now points at wrongly
        assert "\n" not in str(e) and str(path.parent) in str(e), str(e)
    else:
        assert same(got, original), f"{path}: a corrupted file loaded as other content"
    assert path.read_bytes() == before


def _corrupt_checkpoint(finished_run, flips, cut):
    from mapl.core import checkpoint
    original = checkpoint.read(finished_run["ckpt"])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.pt"
        path.write_bytes(_corrupt(finished_run["ckpt"].read_bytes(), flips, cut))
        _refused_or_same(checkpoint.read, path, original, _same_checkpoint)


def _same_checkpoint(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_checkpoint(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_checkpoint, a, b))
    return type(a) is type(b) and a == b


test_a_corrupted_checkpoint_is_refused_in_one_line, test_a_corrupted_checkpoint_many = \
    fuzzed(**CORRUPTION)(_corrupt_checkpoint)


def _corrupt_manifest(finished_run, flips, cut):
    from mapl.data.dataset import verified_manifest
    source = finished_run["data"]
    original = verified_manifest(source)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "data"
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns(".verified-*", "*.lock"))
        path = folder / "manifest.json"
        path.write_bytes(_corrupt(path.read_bytes(), flips, cut))
        # what a reader uses must match; other fields (the source's description) may differ harmlessly
        _refused_or_same(lambda p: verified_manifest(p.parent), path, original, _same_shards)


def _same_shards(a: dict, b: dict) -> bool:
    """The fields a reader uses are equal (a flip in the source's description changes nothing that is read)."""
    def used(m):
        return (m["dtype"], m["vocab_size"], m["tokenizer"]["sha256"],
                [(m["splits"][s]["file"], m["splits"][s]["sha256"], m["splits"][s]["tokens"]) for s in ("train", "val")])
    return used(a) == used(b)


test_a_corrupted_manifest_is_refused_in_one_line, test_a_corrupted_manifest_many = \
    fuzzed(**CORRUPTION)(_corrupt_manifest)


def _corrupt_results(finished_run, flips, cut):
    from mapl.report.rows import load_results
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "results" / "main" / "r.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(_corrupt(finished_run["results"].read_bytes(), flips, cut))
        try:
            json.loads(path.read_bytes())
            readable = True
        except ValueError:
            readable = False
        before = path.read_bytes()
        try:
            got = load_results(Path(d), "results")
        except ValueError as e:
            assert "\n" not in str(e) and str(path) in str(e), str(e)
        else:
            # a file still read as a run's results: its numbers are whatever the bytes now say, so the report
            # takes it or leaves it (not a run's results) -- but never by a traceback
            assert readable and isinstance(got, list)
        assert path.read_bytes() == before


test_a_corrupted_results_file_is_refused_in_one_line, test_a_corrupted_results_file_many = \
    fuzzed(**CORRUPTION)(_corrupt_results)


@pytest.mark.parametrize("argv", [
    ["train", "--profile", "micro", "--out", "{fifo}", "--ckpt", "r.pt"],
    ["train", "--profile", "micro", "--out", "r.json", "--ckpt", "{fifo}"],
    ["pipeline", "--profile", "micro", "--out", "{fifo}", "--ckpt", "r.pt"],
    ["costmodel", "--profile", "micro", "--out", "{fifo}"],
    ["notebook", "notebooks/report.ipynb", "{fifo}"],
], ids=["train-out", "train-ckpt", "pipeline-out", "costmodel-out", "notebook-out"])
def test_every_command_that_writes_refuses_an_output_that_is_not_a_regular_file(no_runs, argv):
    # was: the results JSON renamed over whatever stood at --out (as root, `--out /dev/null` replaced /dev/null)
    os.mkfifo(no_runs / "fifo")
    if argv[0] == "notebook":
        argv = [argv[0], str(Path(mapl.cli.__file__).parents[2] / argv[1]), argv[2]]
    argv = [a.replace("{fifo}", str(no_runs / "fifo")) for a in argv]
    code, err = _run_cli(argv)
    assert code == 2 and err.strip().endswith("it is a FIFO (named pipe), not a regular file; give a file path (an "
                                              "output replaces only regular files)"), err
    assert (no_runs / "fifo").is_fifo()
