"""Shared fixtures: tiny local corpora (never downloads) and micro run configs; the guard that keeps
`make test-fast` in-process (see ``pytest_configure``)."""
import multiprocessing.process
import os
import random
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mapl.core.config import load_run_config
from mapl.data import DataConfig, prepare

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

_TEXT = """First Citizen: Before we proceed any further, hear me speak.
All: Speak, speak.
First Citizen: You are all resolved rather to die than to famish?
All: Resolved. resolved.
First Citizen: First, you know Caius Marcius is chief enemy to the people.
"""


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A byte-tokenized corpus from a few generated documents (enough windows for micro runs)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (root / f"doc{i:02d}.txt").write_text((_TEXT * 30).replace("First", f"Citizen{i}"))
    out = root / "prepared"
    prepare(DataConfig(source="text", paths=(str(root / "doc*.txt"),), tokenizer="byte"), out)
    return out


# the multi-process tests' corpus (test_pipeline, test_runtime_*): one document per file, word salad
WORDS = ("the king queen lord my good sir what shall we do now love heart death night day sword crown fair "
         "speak hear thou art not to be or and with this that").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-tokenized corpus from 12 small text files (one document each), prepared once."""
    root = tmp_path_factory.mktemp("pipeline-corpus")
    rng = random.Random(0)
    for i in range(12):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(120)]
        (root / f"doc{i:02d}.txt").write_text(f"Document {i}.\n" + "\n".join(lines) + "\n")
    glob = str(root / "doc*.txt")
    data_dir = root / "data"
    prepare(DataConfig(source="text", paths=(glob,), tokenizer="byte"), data_dir)
    return {"glob": glob, "data_dir": str(data_dir)}


@pytest.fixture
def micro_cfg(tiny_corpus):
    def make(method="none", ratio=1.0, **over):
        cfg = load_run_config("micro", {"method": method, "ratio": ratio, **over})
        return replace(cfg, data=DataConfig(source="text", paths=(str(tiny_corpus.parent / "doc*.txt"),),
                                            tokenizer="byte"), data_dir=str(tiny_corpus))
    return make


@pytest.fixture(scope="session")
def load_benchmark():
    """``load_benchmark("compress")``: benchmarks/compress.py as a module (the benchmarks are scripts, not a
    package)."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.fixture
def on_meta():
    """Factories without a device land on the meta device: a tensor made without following its
    input's device then meets a real CPU tensor and the op fails (the GPU bug class, without a GPU)."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


# ---- `make test-fast`: in-process tests only ------------------------------------------------------
# The markers (pyproject.toml) split the suite by cost: `process` tests start child processes (a CLI, the
# launcher, pipeline ranks, dvc, papermill), each paying interpreter start-up and usually a torch import;
# `slow` tests are long whatever they run. `make test-fast` deselects both and sets MAPL_TEST_IN_PROCESS=1,
# under which an unmarked test that starts a child process fails and names the marker it lacks, so the fast
# set stays fast as tests are added. `make test` runs every test not marked `full` and sets nothing; `make
# test-all` then runs the `full` ones (the slowest end-to-end cases, which do not fit `make test`'s 10 minutes).
IN_PROCESS_ONLY = os.environ.get("MAPL_TEST_IN_PROCESS") == "1"


# The slowest end-to-end cases, run by `make test-all` but not by `make test` (CI's command; 10 minutes on 2 cores, install
# included): each repeats a contract a faster test of `make test` already checks, named beside it.
FULL_ONLY = {
    "tests/test_bench.py::test_slow_link_benchmark_models_the_planner_against_1f1b":
        "the slow-link benchmark end to end (2 min); its refusals and the cost model's tests stay",
    "tests/test_bench.py::test_slow_link_keep_measured_carries_the_measured_part_or_refuses":
        "a second slow-link benchmark run (75 s)",
    "tests/test_bench.py::test_slow_link_refuses_a_micro_batch_factor_that_does_not_split_the_micro_batch":
        "starts the benchmark to see one refusal; the cost model's argument checks stay",
    "tests/test_bench.py::test_quick_report_has_every_section": "the quick benchmark report end to end",
    "tests/test_pipeline.py::test_deep_1f1b_for_slow_links_is_bit_identical[True]":
        "deep 1F1B on the blocking transport; the non-blocking case stays",
    "tests/test_pipeline.py::test_mapl_rvq_parity[4-1f1b-torchrun-True]":
        "P=4 RVQ parity on the blocking transport; the other RVQ parity cases stay",
    "tests/test_pipeline.py::test_parity_mapl_p2_1f1b_accelerate_blocking_transport":
        "accelerate on the blocking transport; the torchrun parity cases stay",
    "tests/test_pipeline.py::test_sigterm_on_one_rank_stops_all_after_the_same_step_and_resume_is_exact[mapl]":
        "SIGTERM on a MAPL pipeline; the single-process SIGINT resume tests stay",
    "tests/test_frozen_trunk.py::test_a_tuned_projector_runs_its_winner_on_every_seed":
        "the frozen-trunk study's tuning end to end (micro runs)",
    "tests/test_frozen_trunk.py::test_frozen_trunk_trains_only_the_boundaries_and_anchors":
        "the frozen-trunk study end to end (micro runs)",
    "tests/test_rescore.py::test_a_group_is_scored_once_and_only_from_the_committed_checkpoints":
        "the rescore command end to end; its selection tests stay",
    "tests/test_data.py::test_real_shakespeare": "tokenizes the real corpus; the synthetic-corpus tests stay",
    "tests/test_gpu_path.py::test_the_fused_search_is_compiled_before_training_and_the_first_pack_reuses_it":
        "compiles the fused search (15 s)",
    "tests/test_optim.py::test_orthogonality_holds_over_10k_spel_steps[bf16-autocast]":
        "10,000 SPEL steps; the 2,000-step Stiefel tests (1e-5) stay",
    "tests/test_optim.py::test_orthogonality_holds_over_10k_spel_steps[fp32]":
        "10,000 SPEL steps; the 2,000-step Stiefel tests (1e-5) stay",
    "tests/test_peer_pipelining.py::test_smallest_cell_losses_bit_identical_to_the_library":
        "the peer benchmark's smallest cell end to end",
    "tests/test_rvq.py::test_fused_search_transient_memory_is_o_of_tokens_times_groups":
        "a memory measurement over large searches",
    "tests/test_reliability.py::test_a_run_in_a_folder_with_spaces_and_non_ascii_letters_and_no_home":
        "a whole run in an odd folder",
    "tests/test_fast_guard.py::test_a_module_fixture_cannot_start_a_child_process_for_an_unmarked_test[-False]":
        "runs pytest inside pytest",
    "tests/test_fast_guard.py::test_a_module_fixture_cannot_start_a_child_process_for_an_unmarked_test"
    "[@pytest.mark.process-True]": "runs pytest inside pytest",
    "tests/test_protocol.py::test_how_often_a_run_evaluates_does_not_change_its_training[mapl-rvq]":
        "the RVQ case of a contract the MAPL case checks",
}


def pytest_collection_modifyitems(config, items):
    """Mark :data:`FULL_ONLY` `full` (and `slow`). `full` only on a `slow` or `process` test: an in-process unit
    test left out of `make test` would be in `make test-fast` but not in the README's command."""
    for item in items:
        if item.nodeid in FULL_ONLY:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.full)
    wrong = [i.nodeid for i in items if i.get_closest_marker("full")
             and not (i.get_closest_marker("slow") or i.get_closest_marker("process"))]
    if wrong:
        raise pytest.UsageError("marked `full` but neither `slow` nor `process` (an in-process test belongs in "
                                "`make test`): " + ", ".join(wrong))


class ChildProcessInFastTest(AssertionError):
    pass


# ---- the report's tests: a synthetic cpu profile's results tree (tests/helpers/report_data.py) ------------------
@pytest.fixture
def tree(tmp_path):
    """A cpu profile in the per-profile layout, plus a duplicate, a memory plan and another profile."""
    from mapl import report as R
    from tests.helpers.report_data import result, results_groups, write
    base = R.results_dir("cpu", tmp_path)
    groups = results_groups()
    for g, rs in groups.items():
        for r in rs:
            write(base, g, r)
    write(base, "tokens", {**groups["main"][0], "run": "zz-dup"})                   # same config: main keeps it
    write(base, "", {**groups["main"][5], "run": "adhoc-lr", "val_loss": 9.9})      # ad hoc, same key: main wins
    write(base, "main", result("mapl", 8, loss=9.0, model="micro", profile="micro", name="micro-x"))
    (base / "main" / ".gitkeep").write_text("")
    (base / "main" / "x.memory.json").write_text('{"stages": []}')          # no run's results: skipped
    return tmp_path


@pytest.fixture
def rows_all(tree):
    """Every row of the tree's cpu profile, the tuning groups and slice included."""
    from mapl import report as R
    return R.select(R.load_results(tree, R.results_dir("cpu")), profile="cpu", eval_offset=None, tuning=True)


@pytest.fixture
def rows(rows_all):
    """The reported rows of the tree's cpu profile."""
    from mapl import report as R
    return R.select(rows_all)


# The guard is installed once for the session and asks which test is being set up, run or torn down:
# a function-scoped fixture would come too late for a module-scoped fixture of an unmarked test (pytest
# sets up wider scopes first), which could then start child processes unnoticed.
_TEST_NOW = {"name": "", "may_spawn": True}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _TEST_NOW["name"] = item.nodeid
    _TEST_NOW["may_spawn"] = bool(item.get_closest_marker("process") or item.get_closest_marker("slow"))


def _refuse(what: str):
    raise ChildProcessInFastTest(f"{_TEST_NOW['name']} starts a child process ({what}) but is not marked: add "
                                 "@pytest.mark.process (or pytestmark = pytest.mark.process for the module)")


def _guarded(original, describe):
    def start(self, *args, **kwargs):
        if not _TEST_NOW["may_spawn"]:
            _refuse(describe(self, *args))
        return original(self, *args, **kwargs)
    return start


def pytest_configure(config):
    if not IN_PROCESS_ONLY:
        return
    subprocess.Popen._execute_child = _guarded(
        subprocess.Popen._execute_child,
        lambda self, args, *rest: args if isinstance(args, str) else " ".join(map(str, args)))
    multiprocessing.process.BaseProcess.start = _guarded(
        multiprocessing.process.BaseProcess.start, lambda self: f"multiprocessing {self.name}")
