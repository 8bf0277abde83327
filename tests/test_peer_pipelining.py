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
