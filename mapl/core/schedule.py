"""Pipeline schedules as per-stage programs, and a checker that proves them deadlock-free.

A schedule (one registry, ``SCHEDULES``) gives each stage its compute order, ("F", m) and ("B", m).
``stage_program`` turns it into what a worker executes: computes and communication *batches* (``Comm``), the sends
of one compute posted together with the receives of the next, as ``torch.distributed.pipelining`` does: under
rendezvous semantics (NCCL's, and gloo's ``send``) a lone send then a lone receive deadlocks 1F1B at any P.
``check_programs`` replays every stage's program under those semantics, or the default non-blocking transport's,
and raises ``ScheduleError`` on a deadlock or a mismatched pairing.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

__all__ = ["SCHEDULES", "ONE_F_ONE_B", "POSTS_AHEAD", "schedule_ops", "Kind", "Op", "Msg", "Compute", "Transfer",
           "Comm", "Barrier", "Action", "stage_program", "step_tail", "step_program", "eval_program", "check_programs",
           "ScheduleError"]


# ---- the vocabulary of programs (string enums: they compare and hash as their values) --------------
class Kind(StrEnum):
    """A compute action: the forward or the backward of one micro-batch."""
    F = "F"
    B = "B"


class Op(StrEnum):
    SEND = "send"
    RECV = "recv"


class Msg(StrEnum):
    """Activations, their gradients, or a step-end exchange (receiver-side gradients back, learned state forward)."""
    FWD = "fwd"
    BWD = "bwd"
    RGRAD = "rgrad"
    SYNC = "sync"


# ---- compute orders ---------------------------------------------------------------------------------
def _gpipe(n_stages: int, n_micro: int, stage: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (micro-batch order)."""
    return [(Kind.F, m) for m in range(n_micro)] + [(Kind.B, m) for m in range(n_micro)]


def _one_f_one_b(n_stages: int, n_micro: int, stage: int) -> list[tuple[str, int]]:
    """1F1B (PipeDream-flush): ``P - 1 - s`` warm-up forwards, then alternate: at most ``P - s`` alive."""
    return _warm_then_alternate(min(n_stages - 1 - stage, n_micro), n_micro)


def _deep_one_f_one_b(depth: int) -> Callable[[int, int, int], list[tuple[Kind, int]]]:
    """1F1B with ``depth`` times its warm-up, for slow links (docs/pipeline.md, "Slow links"): the first gradient
    returns after a round trip of 2 (P - 1 - s) messages, so plain 1F1B idles the forward channel for half of
    it. The price is ``depth (P - 1 - s) + 1`` graphs alive."""
    def ops(n_stages: int, n_micro: int, stage: int) -> list[tuple[Kind, int]]:
        return _warm_then_alternate(min(depth * (n_stages - 1 - stage), n_micro), n_micro)
    ops.__doc__ = f"1F1B with {depth}x its warm-up (``_deep_one_f_one_b``)."
    return ops


def _warm_then_alternate(warm: int, n_micro: int) -> list[tuple[Kind, int]]:
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
    """The compute operations of ``stage`` in one step. Backwards run in micro-batch order in every schedule, so
    gradients accumulate as in the single-process loop (bit-identical sums)."""
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
    """Transfers posted together; the batch ends when each has met its counterpart. ``ahead``: receives posted now
    but waited by a later batch (the deep 1F1B schedules post a gradient's receive with its forward's send:
    posted only after the warm-up, the neighbour's send of it would deadlock under rendezvous semantics)."""
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
    """``schedule``'s computes with the sends of each and the receives of the next in one ``Comm``; in
    ``POSTS_AHEAD`` schedules the batch sending F(m) also posts B(m)'s gradient receive (``Comm.ahead``)."""
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


def step_tail(n_stages: int, stage: int, receiver_grads: bool, synced_state: bool) -> list[Action]:
    """After the last backward: receiver-side gradients back, the all-reduce, the learned state forward; each
    exchange one batch per stage (no chain of waits)."""
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
    """THE program a worker runs for one optimizer step, (body, tail); ``check_programs(body + tail)`` proves it.
    ``receiver_grads``/``synced_state``: the compressors send gradients back / state forward (the same at
    every boundary, so neighbours agree)."""
    return (stage_program(schedule, n_stages, n_micro, stage),
            step_tail(n_stages, stage, receiver_grads, synced_state))


def eval_program(n_stages: int, stage: int, pieces: int) -> list[Action]:
    """THE program of one evaluation of ``pieces`` forward-only micro-batches: each received, computed and sent on,
    one transfer per batch (no receive posted ahead), then the loss's all-reduce."""
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
    """Replay the stages' programs; raise ``ScheduleError`` on a deadlock, naming where each stage waits. Returns
    the rounds. ``transport``: 'blocking' (a batch ends when each transfer has met its counterpart) or
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
    """The worker's non-blocking transport for ``program`` as ("post", id), ("wait", ids), ("barrier", name), id =
    (stage, action, transfer): a batch posts its receives, sends and the next batch's receives, then waits for its
    receives and every earlier send; a step-end batch and a barrier wait for every send in flight."""
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
    """Each transfer id -> its counterpart's (the k-th send of a pair of stages meets the k-th receive)."""
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
    """Run every stage's ops: a transfer completes once it and its counterpart are both posted, a barrier when every
    stage stands at it. Returns the rounds; ``ScheduleError`` when no stage can move."""
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
