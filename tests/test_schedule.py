"""Pipeline schedules as stage programs, proved deadlock-free under rendezvous (NCCL-like) semantics."""
import pytest

from mapl.core.schedule import (POSTS_AHEAD, SCHEDULES, Barrier, Comm, Compute, ScheduleError, Transfer, _makes, _needs,
                                _nonblocking_ops, check_programs, eval_program, schedule_ops, stage_program,
                                step_program, step_tail)

GRID = [(P, M) for P in (2, 4, 8) for M in (P, 2 * P, 4 * P)]


def naive_program(schedule: str, n_stages: int, n_micro: int, stage: int) -> list:
    """Each transfer alone, where it is needed or made: the checker shows it deadlocks 1F1B."""
    program = []
    for kind, m in schedule_ops(schedule, n_stages, n_micro, stage):
        program += [Comm((t,)) for t in _needs(kind, m, stage, n_stages)]
        program.append(Compute(kind, m))
        program += [Comm((t,)) for t in _makes(kind, m, stage, n_stages)]
    return program


@pytest.mark.parametrize("tail", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("transport", ["blocking", "non-blocking"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("P,M", GRID)
def test_programs_are_deadlock_free_under_rendezvous_semantics(schedule, P, M, transport, tail):
    """The whole step each stage worker runs (``step_program``: the computes and their batches, then the
    step-end exchanges: receiver-side gradients, all-reduce, state sync, for methods with and without
    them) completes when every send waits for its receive to be posted: each batch's sends waited in
    the batch (blocking), or released one batch later with the next batch's receives posted ahead (the
    default transport)."""
    programs = [sum(step_program(schedule, P, M, s, *tail), []) for s in range(P)]
    rounds = check_programs(programs, transport)
    assert rounds <= 2 * M + 4 * P          # no serialisation beyond the pipeline's own fill and drain


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("P,M", GRID)
def test_the_non_blocking_transport_holds_at_most_two_sends(schedule, P, M):
    """Sends posted and not yet waited, at any point of a stage's non-blocking ops: the batch's own and
    the one before (every send of the step before sends were released: up to 2M on a middle stage)."""
    for s in range(P):
        program = stage_program(schedule, P, M, s) + step_tail(P, s, receiver_grads=True, synced_state=True)
        held, peak = set(), 0
        for kind, arg in _nonblocking_ops(s, program):
            if kind == "post" and program[arg[1]].transfers[arg[2]].op == "send":
                held.add(arg)
            elif kind == "wait":
                held -= set(arg)
            peak = max(peak, len(held))
        assert peak <= 2 and not held


@pytest.mark.parametrize("transport", ["blocking", "non-blocking"])
@pytest.mark.parametrize("P,pieces", [(2, 1), (2, 5), (4, 3), (8, 8)])
def test_the_evaluation_program_is_a_checked_forward_chain(P, pieces, transport):
    """The evaluation the worker interprets (``eval_program``): every piece received, computed and sent on in
    order, one transfer per batch, then one all-reduce every stage joins; deadlock-free in both transports,
    and each middle stage's k-th receive is the k-th message its predecessor sends."""
    programs = [eval_program(P, s, pieces) for s in range(P)]
    check_programs(programs, transport)
    for s, prog in enumerate(programs):
        assert [a.mb for a in prog if isinstance(a, Compute)] == list(range(pieces))
        assert all(a.kind == "F" for a in prog if isinstance(a, Compute))
        assert prog[-1] == Barrier("validation loss") and sum(isinstance(a, Barrier) for a in prog) == 1
        comms = [a for a in prog if isinstance(a, Comm)]
        assert all(len(c.transfers) == 1 for c in comms)
        assert len(comms) == pieces * ((s > 0) + (s < P - 1))
    with pytest.raises(ScheduleError, match="deadlock"):       # a stage that skips the barrier is caught
        check_programs([eval_program(P, s, pieces)[:-1] if s == 0 else eval_program(P, s, pieces)
                        for s in range(P)], transport)


def test_the_non_blocking_checker_catches_a_deadlock_made_by_releasing_sends():
    """Stage 0 waits for its first send at its second batch; stage 1 posts that receive only after
    hearing from stage 2, which waits for stage 0's third send: with sends held to the step's end this
    would run, released one batch later it cannot."""
    C = Compute("F", 0)
    progs = [[Comm((Transfer("send", "fwd", 0, 1),)), C, Comm((Transfer("send", "fwd", 0, 2),)), C,
              Comm((Transfer("send", "fwd", 1, 2),))],
             [Comm((Transfer("recv", "bwd", 0, 2),)), C, Comm((Transfer("recv", "bwd", 1, 2),)), C,
              Comm((Transfer("recv", "fwd", 0, 0),))],
             [Comm((Transfer("recv", "fwd", 0, 0),)), C, Comm((Transfer("recv", "fwd", 1, 0),)), C,
              Comm((Transfer("send", "bwd", 0, 1),)), C, Comm((Transfer("send", "bwd", 1, 1),))]]
    with pytest.raises(ScheduleError, match=r"non-blocking transport: \{0: \('wait', \[\(0, 0, 0\)\]\)"):
        check_programs(progs, "non-blocking")
    with pytest.raises(ValueError, match="transport='nccl' is invalid"):
        check_programs(progs, "nccl")


@pytest.mark.parametrize("P,M", GRID)
def test_the_first_runtimes_op_order_deadlocks_1f1b(P, M):
    """The checker is not vacuous: a lone send followed by a lone receive (the first runtime's order,
    safe only because gloo's isend was waited at the end of the step) deadlocks 1F1B at every P."""
    with pytest.raises(ScheduleError, match="deadlock"):
        check_programs([naive_program("1f1b", P, M, s) for s in range(P)])
    check_programs([naive_program("gpipe", P, M, s) for s in range(P)])      # GPipe's order happens to be safe


def test_checker_catches_messages_that_would_meet_the_wrong_receive():
    progs = [stage_program("gpipe", 2, 2, s) for s in range(2)]
    swapped = [Comm((Transfer("recv", "fwd", 1, 0),)) if a == Comm((Transfer("recv", "fwd", 0, 0),)) else
               Comm((Transfer("recv", "fwd", 0, 0),)) if a == Comm((Transfer("send", "bwd", 0, 0),
                                                                       Transfer("recv", "fwd", 1, 0))) else a
               for a in progs[1]]
    with pytest.raises(ScheduleError, match="wrong receive"):
        check_programs([progs[0], swapped])


def test_a_barrier_waits_for_every_stage():
    with pytest.raises(ScheduleError, match="deadlock"):
        check_programs([[Barrier("x"), Comm((Transfer("send", "fwd", 0, 1),))],
                        [Comm((Transfer("recv", "fwd", 0, 0),)), Barrier("x")]])


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_batch_pairs_the_last_compute_sends_with_the_next_compute_receives(schedule):
    P, M = 4, 8
    for s in range(P):
        prog = stage_program(schedule, P, M, s)
        computes = [(a.kind, a.mb) for a in prog if isinstance(a, Compute)]
        assert computes == schedule_ops(schedule, P, M, s)
        for a in prog:
            if isinstance(a, Comm):
                assert len(a.sends()) <= 1 and len(a.recvs()) <= 1
        for i, a in enumerate(prog):             # every compute's input is received right before it
            if isinstance(a, Compute) and (a.kind == "F" and s > 0 or a.kind == "B" and s < P - 1):
                assert isinstance(prog[i - 1], Comm)
                assert (a.kind == "F") == (prog[i - 1].recvs()[0].what == "fwd")
                assert prog[i - 1].recvs()[0].mb == a.mb


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("P,M", [(2, 2), (4, 4), (4, 8), (3, 5)])
def test_schedule_ops_cover_every_micro_batch_once(schedule, P, M):
    for s in range(P):
        ops = schedule_ops(schedule, P, M, s)
        assert sorted(ops) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
        assert [m for k, m in ops if k == "B"] == list(range(M))       # backward in micro-batch order
        for m in range(M):
            assert ops.index(("F", m)) < ops.index(("B", m))
        if schedule == "1f1b":      # at most P - s micro-batches in flight on stage s
            live = peak = 0
            for k, _ in ops:
                live += 1 if k == "F" else -1
                peak = max(peak, live)
            assert peak == min(P - s, M)


def test_schedule_ops_rejects_unknown():
    with pytest.raises(ValueError, match="schedule"):
        schedule_ops("interleaved", 2, 2, 0)


def test_the_config_knows_exactly_the_registered_schedules():
    from mapl.core.config import SCHEDULES as CONFIG_SCHEDULES
    assert set(CONFIG_SCHEDULES) == set(SCHEDULES)


# ---- the deep 1F1B schedules for slow links ---------------------------------------------------------------------
DEEP = [s for s in sorted(SCHEDULES) if s in POSTS_AHEAD]


@pytest.mark.parametrize("schedule", DEEP)
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 32), (8, 16)])
def test_deep_schedules_hold_their_warm_up_and_post_each_gradient_receive_with_its_forward(schedule, P, M):
    """1f1b-x<k>: k (P - 1 - s) warm-up forwards on stage s (capped at M), and the batch that
    sends F(m) posts the receive of B(m)'s gradient ahead, which a later batch waits for."""
    k = int(schedule.rsplit("x", 1)[1])
    for s in range(P):
        ops = schedule_ops(schedule, P, M, s)
        assert ops.index(("B", 0)) == min(k * (P - 1 - s) + 1, M)      # the warm-up, then one more F
        prog = stage_program(schedule, P, M, s)
        for i, a in enumerate(prog):
            if isinstance(a, Comm) and a.ahead:
                (early,) = a.ahead
                (sent,) = [t for t in a.sends() if t.what == "fwd"]
                assert (early.op, early.what, early.mb, early.peer) == ("recv", "bwd", sent.mb, s + 1)
                assert any(isinstance(b, Comm) and early in b.transfers for b in prog[i + 1:])
        assert sum(len(a.ahead) for a in prog if isinstance(a, Comm)) == (M if s < P - 1 else 0)


@pytest.mark.parametrize("schedule", ["1f1b-x3", "1f1b-x4"])
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 32)])
def test_a_deep_warm_up_without_early_gradient_receives_deadlocks(schedule, P, M):
    """Why ``Comm.ahead`` exists: stage s sends its warm-up forwards while s + 1 waits to send a gradient
    that s receives only after them. Under rendezvous semantics that is a deadlock from 3x the warm-up on
    (at 2x each stage's extra forwards happen to meet the neighbour's receives)."""
    plain = [[Comm(a.transfers) if isinstance(a, Comm) else a for a in stage_program(schedule, P, M, s)]
             for s in range(P)]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_programs(plain)
    check_programs([stage_program(schedule, P, M, s) for s in range(P)])
