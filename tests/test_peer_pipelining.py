"""benchmarks/peer_pipelining.py: our runtime and torch.distributed.pipelining train the same stages to the
same losses, and the library's refusals are the ones the README states."""
import pytest

from mapl.core.compress import build_boundary
from mapl.core.config import load_run_config


@pytest.fixture(scope="module")
def peer(load_benchmark):
    return load_benchmark("peer_pipelining")


@pytest.mark.parametrize("method,ratio,carried", [("none", 1, True), ("mapl", 4, True), ("ssn", 4, True),
                                                  ("int8", 1, False), ("mapl-rvq", 4, False)])
def test_library_carries_only_float_messages_with_same_shaped_gradients(peer, method, ratio, carried):
    cfg = load_run_config("micro", {"method": method, "ratio": ratio})
    d = cfg.model_config().d_model
    why = peer.library_refusal(build_boundary(cfg.compressor.validate(d), d, 0), (2, 32))
    assert (why is None) == carried, why
    if not carried:
        assert "integer" in why and "no gradient" in why


@pytest.mark.slow
def test_smallest_cell_losses_bit_identical_to_the_library(peer, micro_cfg):
    """P = 2, M = 4, GPipe, 3 steps: none and MAPL (token ids as a second output), both engines alternating
    in the same two processes; every step's loss and every stage's gradient norm is the same float."""
    over = {"stages": 2, "train.micro_batches": 4, "train.schedule": "gpipe", "train.threads": 1}
    cfgs = [micro_cfg("none", **over), micro_cfg("mapl", 4.0, **over)]
    cells = [peer.summarize(cfg, ranks, warmup=1) for cfg, ranks in zip(cfgs, peer.run_group(cfgs, steps=3))]
    for c in cells:
        assert c["same_initial_weights"], c["method"]
        assert len(c["ours"]["loss"]) == 3 and c["ours"]["loss"][0] > 0
        assert c["ours"]["loss"] != [c["ours"]["loss"][0]] * 3          # it trains: the loss moves
        assert c["loss_bit_identical"], (c["method"], c["ours"]["loss"], c["library"]["loss"])
        assert c["grad_norm_bit_identical"], (c["method"], c["grad_norm_max_rel_diff"])
        assert c["ours"]["median_step_s"] > 0 and c["library"]["median_step_s"] > 0
        # the engines' own part (barrier to the shared finish_step) is timed per step, and is less than the step
        for name in ("ours", "library"):
            assert 0 < c["schedule_only"][f"{name}_median_s"] < c[name]["median_step_s"]
        assert c["schedule_only"]["n"] == 2 and c["schedule_only"]["ci"][0] <= c["schedule_only"]["ratio"]


def test_ratio_interval_is_the_geometric_mean_with_a_t_interval_and_its_resolution(peer):
    """Steps of equal ratio: the interval is that ratio alone and any difference resolves; noisy steps widen it
    and a 5 % difference is out of reach; pooling spans the cells, not the steps."""
    import math
    same = peer.ratio_interval([1.1, 2.2, 3.3], [1.0, 2.0, 3.0])
    assert math.isclose(same["ratio"], 1.1) and all(math.isclose(x, 1.1) for x in same["ci"])
    assert abs(same["mde"]) < 1e-12 and same["resolves_5pct"]
    noisy = peer.ratio_interval([1.0, 1.3, 0.8, 1.2], [1.0, 1.0, 1.0, 1.0])
    assert noisy["ci"][0] < noisy["ratio"] < noisy["ci"][1] and noisy["mde"] > 0.05 and not noisy["resolves_5pct"]
    lo = math.exp(math.log(noisy["ratio"]) - (math.log(noisy["ci"][1]) - math.log(noisy["ratio"])))
    assert math.isclose(noisy["ci"][0], lo)                                  # symmetric on the log scale
    pooled = peer.pooled_ratio([same, noisy])
    assert pooled["cells"] == 2 and math.isclose(pooled["ratio"], math.sqrt(1.1 * noisy["ratio"]))
    assert peer.pooled_ratio([same]) is None
