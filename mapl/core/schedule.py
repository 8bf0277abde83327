"""Pipeline schedules as per-stage programs, and a checker that proves them deadlock-free.

A schedule (GPipe, 1F1B, and 1F1B with 2-4x its warm-up for slow links; one registry, ``SCHEDULES``)
gives each stage its compute order: ("F", m) forward and ("B", m) backward of micro-batch m.
``stage_program`` turns it into what a stage worker executes: compute actions and communication
*batches*. A forward on stage s > 0 needs the activation of stage s-1; a backward on s < P-1 needs the
gradient of stage s+1; each compute produces the message its neighbour needs. The sends produced by one
compute and the receives needed by the next are posted together in one batch (``Comm``), as
``torch.distributed.pipelining`` does: with rendezvous semantics (an NCCL send completes only once the
peer has posted the matching receive; gloo's ``send`` behaves the same way) a lone send followed by a
lone receive deadlocks 1F1B at any P (stage s waits to send F(m+1) while s+1 waits to send B(m) back).

``check_programs`` replays the programs of all stages under exactly those semantics (every op of a
batch is posted at once; a batch ends when each of its ops has met its counterpart; per pair of
stages, messages meet in order) and raises ``ScheduleError`` on a deadlock or a mismatched pairing.
The worker's blocking transport (``mapl.core.runtime.transport``) has the same semantics, so a schedule
that passes here runs on it, and on NCCL. ``transport="non-blocking"`` replays what the default
transport does instead: a batch posts its receives, its sends and the next batch's receives (look
ahead), then waits for its receives and for the sends of the batches before it (released one batch
later, not held to the step's end); a step-end batch (micro-batch -1) and a barrier complete every
send in flight first (``flush``).

    >>> prog = stage_program("1f1b", n_stages=4, n_micro=8, stage=1)
    >>> check_programs([stage_program("1f1b", 4, 8, s) for s in range(4)])     # raises on deadlock
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

__all__ = ["SCHEDULES", "ONE_F_ONE_B", "POSTS_AHEAD", "schedule_ops", "Kind", "Op", "Msg", "Compute", "Transfer",
           "Comm", "Barrier", "Action", "stage_program", "step_tail", "step_program", "eval_program", "check_programs",
           "ScheduleError", "naive_program"]


# ---- the vocabulary of programs (string enums: they compare and hash as their values) --------------
class Kind(StrEnum):
    """A compute action: the forward or the backward of one micro-batch."""
    F = "F"
    B = "B"


class Op(StrEnum):
    SEND = "send"
    RECV = "recv"


class Msg(StrEnum):
    """What a message carries: activations, their gradients, or a step-end exchange (receiver-side
    projector gradients back, the learned state forward)."""
    FWD = "fwd"
    BWD = "bwd"
    RGRAD = "rgrad"
    SYNC = "sync"


# ---- compute orders ---------------------------------------------------------------------------------
def _gpipe(n_stages: int, n_micro: int, stage: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (micro-batch order)."""
    return [(Kind.F, m) for m in range(n_micro)] + [(Kind.B, m) for m in range(n_micro)]


def _one_f_one_b(n_stages: int, n_micro: int, stage: int) -> list[tuple[str, int]]:
    """Non-interleaved 1F1B (PipeDream-flush): ``P - 1 - s`` warm-up forwards, then one forward / one
    backward alternately, then the remaining backwards: at most ``P - s`` micro-batches alive."""
    return _warm_then_alternate(min(n_stages - 1 - stage, n_micro), n_micro)


def _deep_one_f_one_b(depth: int) -> Callable[[int, int, int], list[tuple[Kind, int]]]:
    """1F1B with ``depth`` times its warm-up (``depth (P - 1 - s)`` forwards before the first backward),
    for links slower than compute. Under 1F1B stage s may run ahead of its first gradient by P - 1 - s
    forwards, but that gradient returns only after a round trip of 2 (P - 1 - s) messages (its forward
    down the pipe, its gradient back): on a link-bound step the forward channel idles for half of it.
    ``depth`` 2 keeps the channel busy through the round trip when messages dominate; 3 also covers
    compute of about a message's time. The price is memory: ``depth (P - 1 - s) + 1`` graphs alive
    (``mapl.core.memory`` reads it off these orders), so the planner takes it only where the plan fits."""
    def ops(n_stages: int, n_micro: int, stage: int) -> list[tuple[Kind, int]]:
        return _warm_then_alternate(min(depth * (n_stages - 1 - stage), n_micro), n_micro)
    ops.__doc__ = f"1F1B with {depth}x its warm-up (``_deep_one_f_one_b``)."
    return ops


def _warm_then_alternate(warm: int, n_micro: int) -> list[tuple[Kind, int]]:
    """``warm`` forwards, then forward / backward alternately, then the backwards left (micro-batch order)."""
    ops = [(Kind.F, m) for m in range(warm)]
    for i in range(n_micro - warm):
        ops += [(Kind.F, warm + i), (Kind.B, i)]
    return ops + [(Kind.B, m) for m in range(n_micro - warm, n_micro)]


# the one registry of schedules; config validates train.schedule against its names (this module imports no torch)
SCHEDULES: dict[str, Callable[[int, int, int], list[tuple[Kind, int]]]] = {
    "gpipe": _gpipe, "1f1b": _one_f_one_b,
    **{f"1f1b-x{k}": _deep_one_f_one_b(k) for k in (2, 3, 4)}}
ONE_F_ONE_B = tuple(n for n in SCHEDULES if n.startswith("1f1b"))     # need M >= P (config checks it)
POSTS_AHEAD = tuple(n for n in ONE_F_ONE_B if n != "1f1b")            # post gradient receives early (``Comm.ahead``)


def schedule_ops(schedule: str, n_stages: int, n_micro: int, stage: int) -> list[tuple[Kind, int]]:
    """The compute operations of ``stage`` in one step, in order. Backwards run in micro-batch order in
    every schedule, so each parameter accumulates its gradient in the order of the single-process loop
    (bit-identical sums)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is invalid: allowed {list(SCHEDULES)}")
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage={stage} is invalid: must be in [0, {n_stages})")
    return SCHEDULES[schedule](n_stages, n_micro, stage)


# ---- programs -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    kind: Kind
    mb: int                      # the micro-batch's index in the step


@dataclass(frozen=True)
class Transfer:
    op: Op
    what: Msg
    mb: int                      # the micro-batch's index (-1 for step-end messages)
    peer: int                    # the other stage


@dataclass(frozen=True)
class Comm:
    """Transfers posted together; the batch ends when every one has met its counterpart. ``ahead``:
    receives posted with this batch but waited by the later batch that lists them in its ``transfers``
    (the deep 1F1B schedules post each gradient's receive as soon as its forward is sent: under
    rendezvous semantics the neighbour's send of it would otherwise wait on a receive this stage posts
    only after its remaining warm-up forwards, while this stage waits to send those forwards)."""
    transfers: tuple[Transfer, ...]
    ahead: tuple[Transfer, ...] = ()

    def recvs(self) -> list[Transfer]:
        return [t for t in self.transfers if t.op is Op.RECV]

    def sends(self) -> list[Transfer]:
        return [t for t in self.transfers if t.op is Op.SEND]


@dataclass(frozen=True)
class Barrier:
    """A collective every stage joins (the step's all-reduce)."""
    name: str


Action = Compute | Comm | Barrier


def _needs(kind: str, m: int, s: int, P: int) -> list[Transfer]:
    if kind is Kind.F:
        return [Transfer(Op.RECV, Msg.FWD, m, s - 1)] if s > 0 else []
    return [Transfer(Op.RECV, Msg.BWD, m, s + 1)] if s < P - 1 else []


def _makes(kind: str, m: int, s: int, P: int) -> list[Transfer]:
    if kind is Kind.F:
        return [Transfer(Op.SEND, Msg.FWD, m, s + 1)] if s < P - 1 else []
    return [Transfer(Op.SEND, Msg.BWD, m, s - 1)] if s > 0 else []


def stage_program(schedule: str, n_stages: int, n_micro: int, stage: int) -> list[Action]:
    """Compute actions of ``schedule`` with the sends of each compute and the receives of the next one
    fused into one ``Comm`` batch (deadlock-free under rendezvous semantics; ``check_programs``). In the
    schedules of ``POSTS_AHEAD`` the batch that sends forward F(m) also posts the receive of its gradient
    (``Comm.ahead``), waited before B(m)."""
    program: list[Action] = []
    pending: list[Transfer] = []                 # sends produced by the previous compute
    for kind, m in schedule_ops(schedule, n_stages, n_micro, stage):
        batch = pending + _needs(kind, m, stage, n_stages)
        early = [Transfer(Op.RECV, Msg.BWD, t.mb, t.peer) for t in pending
                 if schedule in POSTS_AHEAD and t.what is Msg.FWD]
        early = [t for t in early if t not in batch]
        if batch:
            program.append(Comm(tuple(batch), tuple(early)))
        program.append(Compute(kind, m))
        pending = _makes(kind, m, stage, n_stages)
    if pending:
        program.append(Comm(tuple(pending)))
    return program


def naive_program(schedule: str, n_stages: int, n_micro: int, stage: int) -> list[Action]:
    """Each transfer alone, right where it is needed or made (the order of the first runtime): the
    checker shows that it deadlocks 1F1B under rendezvous semantics."""
    program: list[Action] = []
    for kind, m in schedule_ops(schedule, n_stages, n_micro, stage):
        program += [Comm((t,)) for t in _needs(kind, m, stage, n_stages)]
        program.append(Compute(kind, m))
        program += [Comm((t,)) for t in _makes(kind, m, stage, n_stages)]
    return program


def step_tail(n_stages: int, stage: int, receiver_grads: bool, synced_state: bool) -> list[Action]:
    """After the last backward: receiver-side gradients back to the sender, the all-reduce, then the
    learned state forward to the receiver; each exchange is one batch per stage (no chain of waits)."""
    s, P = stage, n_stages
    tail: list[Action] = []
    if receiver_grads:
        tail.append(Comm(tuple([Transfer(Op.SEND, Msg.RGRAD, -1, s - 1)] * (s > 0) +
                               [Transfer(Op.RECV, Msg.RGRAD, -1, s + 1)] * (s < P - 1))))
    tail.append(Barrier("step all-reduce"))
    if synced_state:
        tail.append(Comm(tuple([Transfer(Op.SEND, Msg.SYNC, -1, s + 1)] * (s < P - 1) +
                               [Transfer(Op.RECV, Msg.SYNC, -1, s - 1)] * (s > 0))))
    return [a for a in tail if not isinstance(a, Comm) or a.transfers]


def step_program(schedule: str, n_stages: int, n_micro: int, stage: int, receiver_grads: bool,
                 synced_state: bool) -> tuple[list[Action], list[Action]]:
    """THE program a stage worker runs for one optimizer step, as (body, tail): the schedule's computes and
    their communication batches, then the step's end (``step_tail``). The worker interprets both
    (``mapl.core.runtime.worker``) and ``check_programs(body + tail)`` proves the whole step deadlock-free.
    ``receiver_grads``/``synced_state``: the boundaries' compressors send receiver-side gradients back /
    learned state forward (every boundary of a run has the same compressor, so neighbours agree)."""
    return (stage_program(schedule, n_stages, n_micro, stage),
            step_tail(n_stages, stage, receiver_grads, synced_state))


def eval_program(n_stages: int, stage: int, pieces: int) -> list[Action]:
    """THE program a stage worker runs for one evaluation of ``pieces`` forward-only micro-batches: each is
    received from stage s-1, computed and sent on to stage s+1, one transfer per batch, then the all-reduce
    of the loss (``Barrier``). A forward-only chain cannot deadlock under rendezvous semantics, and no receive
    is posted ahead, so a stage never holds more than the message it works on (the worker also completes
    every validation batch's sends before the next: the whole set's messages are never held at once).
    The worker interprets it (``PipelineEngine._validation_loss``); ``check_programs`` replays it."""
    program: list[Action] = []
    for m in range(pieces):
        program += [Comm((t,)) for t in _needs(Kind.F, m, stage, n_stages)]
        program.append(Compute(Kind.F, m))
        program += [Comm((t,)) for t in _makes(Kind.F, m, stage, n_stages)]
    return program + [Barrier("validation loss")]


# ---- the checker ------------------------------------------------------------------------------------------
class ScheduleError(RuntimeError):
    """A set of stage programs that deadlocks or pairs messages wrongly."""


def _pairing(programs: list[list[Action]]) -> None:
    """Per ordered pair of stages, the k-th send meets the k-th receive: they must carry the same message."""
    sent: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], list] = {}
    for s, prog in enumerate(programs):
        for a in prog:
            for t in a.transfers if isinstance(a, Comm) else ():
                if not 0 <= t.peer < len(programs) or t.peer == s:
                    raise ScheduleError(f"stage {s}: {t} names no neighbouring stage")
                book, key = (sent, (s, t.peer)) if t.op == "send" else (got, (t.peer, s))
                book.setdefault(key, []).append((t.what, t.mb))
    for key in sorted(set(sent) | set(got)):
        if sent.get(key, []) != got.get(key, []):
            raise ScheduleError(f"stage {key[0]} sends {sent.get(key, [])} to stage {key[1]}, which receives "
                                f"{got.get(key, [])}: messages would meet the wrong receive")


def check_programs(programs: list[list[Action]], transport: str = "blocking") -> int:
    """Replay the stages' programs under rendezvous semantics; raise ``ScheduleError`` on a deadlock
    (naming where each stage waits). Returns the number of rounds (a measure of serialisation).
    ``transport``: 'blocking' (a batch ends when each of its transfers has met its counterpart) or
    'non-blocking' (the default transport's posting and waiting order: :func:`_nonblocking_ops`)."""
    _pairing(programs)
    if transport == "non-blocking":
        return _replay_posted([_nonblocking_ops(s, prog) for s, prog in enumerate(programs)], programs)
    if transport != "blocking":
        raise ValueError(f"transport={transport!r} is invalid: allowed 'blocking', 'non-blocking'")
    P = len(programs)
    pc = [0] * P
    matched = [set() for _ in range(P)]         # indices of the current batch's transfers already met
    early: list[dict] = [{} for _ in range(P)]  # receives posted ahead: (what, mb, peer) -> met yet
    count = {}                                   # (src, dst) -> messages already met (FIFO position)
    rounds = 0
    while any(pc[s] < len(programs[s]) for s in range(P)):
        rounds += 1
        progressed = _advance_local(programs, pc)
        _post_ahead(programs, pc, early)
        progressed |= _match_transfers(programs, pc, matched, count, early)
        progressed |= _finish(programs, pc, matched, early)
        if not progressed:
            where = {s: programs[s][pc[s]] if pc[s] < len(programs[s]) else "done" for s in range(P)}
            raise ScheduleError(f"deadlock: every stage waits ({where})")
    return rounds


def _advance_local(programs, pc) -> bool:
    """Computes always complete; a barrier completes when every stage stands at it."""
    moved = False
    for s, prog in enumerate(programs):
        while pc[s] < len(prog) and isinstance(prog[pc[s]], Compute):
            pc[s] += 1
            moved = True
    at_barrier = [pc[s] < len(p) and isinstance(p[pc[s]], Barrier) for s, p in enumerate(programs)]
    if all(at_barrier):
        for s in range(len(programs)):
            pc[s] += 1
        moved = True
    return moved


def _post_ahead(programs, pc, early) -> None:
    """A stage standing at a batch has posted the batch's ``ahead`` receives."""
    for s, prog in enumerate(programs):
        if pc[s] < len(prog) and isinstance(prog[pc[s]], Comm):
            for u in prog[pc[s]].ahead:
                early[s].setdefault((u.what, u.mb, u.peer), False)


def _match_transfers(programs, pc, matched, count, early) -> bool:
    """A posted send meets the posted receive that is next in line for that pair of stages (in the
    receiver's current batch, or posted ahead by an earlier one)."""
    moved = False
    for s, prog in enumerate(programs):
        if pc[s] >= len(prog) or not isinstance(prog[pc[s]], Comm):
            continue
        for i, t in enumerate(prog[pc[s]].transfers):
            if t.op != "send" or i in matched[s]:
                continue
            d = t.peer
            if early[d].get((t.what, t.mb, s)) is False and _is_next(programs, s, d, t, count):
                early[d][(t.what, t.mb, s)] = True
                matched[s].add(i)
                count[(s, d)] = count.get((s, d), 0) + 1
                moved = True
                continue
            if pc[d] >= len(programs[d]) or not isinstance(programs[d][pc[d]], Comm):
                continue
            for j, u in enumerate(programs[d][pc[d]].transfers):
                if u.op == "recv" and u.peer == s and j not in matched[d] and (u.what, u.mb) == (t.what, t.mb) \
                        and (u.what, u.mb, s) not in early[d]:
                    if _is_next(programs, s, d, t, count):
                        matched[s].add(i)
                        matched[d].add(j)
                        count[(s, d)] = count.get((s, d), 0) + 1
                        moved = True
                    break
    return moved


def _is_next(programs, s, d, t, count) -> bool:
    """Messages between one pair meet in the order they were sent (NCCL has no tags)."""
    k = count.get((s, d), 0)
    seq = [(u.what, u.mb) for a in programs[s] if isinstance(a, Comm) for u in a.transfers
           if u.op == "send" and u.peer == d]
    return seq[k] == (t.what, t.mb)


def _finish(programs, pc, matched, early) -> bool:
    moved = False
    for s, prog in enumerate(programs):
        if pc[s] < len(prog) and isinstance(prog[pc[s]], Comm):   # receives met while posted ahead
            matched[s] |= {j for j, u in enumerate(prog[pc[s]].transfers)
                           if u.op == "recv" and early[s].get((u.what, u.mb, u.peer))}
        if pc[s] < len(prog) and isinstance(prog[pc[s]], Comm) and len(matched[s]) == len(prog[pc[s]].transfers):
            pc[s] += 1
            matched[s] = set()
            moved = True
    return moved


# ---- the non-blocking transport: posted operations, waited later ---------------------------------------
def _nonblocking_ops(s: int, program: list[Action]) -> list[tuple]:
    """What the worker's non-blocking transport does for ``program`` (``PipelineEngine._communicate``,
    ``finish_step``): ("post", id), ("wait", ids) and ("barrier", name), where id = (stage, action
    index, transfer index). A schedule batch posts its receives (unless posted ahead), its sends and
    the next schedule batch's receives, then waits for its receives and for every earlier send; a
    step-end batch (every transfer's micro-batch -1: ``Transport.exchange`` + ``flush``) and a barrier
    (``flush`` before the all-reduce) wait for every send in flight."""
    def ids(i: int, op: str) -> list:
        return [(s, i, j) for j, t in enumerate(program[i].transfers) if t.op == op]
    comms = [i for i, a in enumerate(program) if isinstance(a, Comm)]

    def later(i: int, t: Transfer) -> tuple:           # the id of an ahead receive: where it is waited
        k = next(k for k in comms if k > i and t in program[k].transfers)
        return (s, k, program[k].transfers.index(t))
    ops, posted, sends = [], set(), []
    for i, a in enumerate(program):
        if isinstance(a, Barrier):
            ops += [("wait", list(sends)), ("barrier", a.name)]
        if not isinstance(a, Comm):
            continue
        step_end = all(t.mb < 0 for t in a.transfers)
        nxt = next((k for k in comms if k > i), None)
        ahead = ids(nxt, "recv") if nxt is not None and not step_end and \
            not all(t.mb < 0 for t in program[nxt].transfers) else []
        earlier = list(sends)
        for x in ids(i, "recv") + ids(i, "send") + ahead + [later(i, t) for t in a.ahead]:
            if x not in posted:
                posted.add(x)
                ops.append(("post", x))
        sends += ids(i, "send")
        ops.append(("wait", ids(i, "recv") + (list(sends) if step_end else earlier)))
    return ops


def _partners(programs: list[list[Action]]) -> dict:
    """Each transfer id -> the id of its counterpart (the k-th send of a pair of stages meets the k-th
    receive: ``_pairing`` has checked that they carry the same message)."""
    lines: dict[tuple[int, int, str], list] = {}
    for s, prog in enumerate(programs):
        for i, a in enumerate(prog):
            for j, t in enumerate(a.transfers if isinstance(a, Comm) else ()):
                pair = (s, t.peer) if t.op == "send" else (t.peer, s)
                lines.setdefault((*pair, t.op), []).append((s, i, j))
    out = {}
    for (src, dst, op), xs in lines.items():
        if op == "send":
            for x, y in zip(xs, lines.get((src, dst, "recv"), [])):
                out[x], out[y] = y, x
    return out


def _replay_posted(ops: list[list[tuple]], programs: list[list[Action]]) -> int:
    """Run every stage's ops; a transfer has completed once it and its counterpart are both posted (a send
    meets a posted receive; per channel both sides post in message order); a barrier completes when every
    stage stands at it. Returns the rounds; raises ``ScheduleError`` when no stage can move."""
    partner, posted = _partners(programs), set()
    pc, P, rounds = [0] * len(ops), len(ops), 0

    def done(x) -> bool:
        return x in posted and partner.get(x) in posted
    while any(pc[s] < len(ops[s]) for s in range(P)):
        rounds += 1
        moved = False
        for s in range(P):
            while pc[s] < len(ops[s]):
                kind, arg = ops[s][pc[s]]
                if kind == "post":
                    posted.add(arg)
                elif kind == "barrier" or not all(done(x) for x in arg):
                    break
                pc[s] += 1
                moved = True
        if all(pc[s] < len(ops[s]) and ops[s][pc[s]][0] == "barrier" for s in range(P)):
            pc = [c + 1 for c in pc]
            moved = True
        if not moved:
            where = {s: ops[s][pc[s]] if pc[s] < len(ops[s]) else "done" for s in range(P)}
            raise ScheduleError(f"deadlock: every stage waits (non-blocking transport: {where})")
    return rounds
