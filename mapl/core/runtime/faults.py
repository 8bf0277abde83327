"""Fault injection for the multi-process tests, parsed once from the environment; and what makes a
stage process leave when its launcher dies.

Variables (all optional; a malformed one is refused with a one-line error at start-up):

* ``MAPL_FAULT_KILL_RANK=r MAPL_FAULT_KILL_STEP=k``: rank r leaves with ``os._exit(1)`` in the middle
  of step k (0-based, after its first forward), or, with ``MAPL_FAULT_MODE=hang``, stops answering
  for ``MAPL_FAULT_HANG_S`` seconds (default 300) and then leaves;
* ``MAPL_FAULT_SIGTERM_RANK=r MAPL_FAULT_SIGTERM_STEP=k``: rank r sends itself a real SIGTERM at the
  start of step k (a graceful stop must follow: every rank finishes step k and exits 130);
* ``MAPL_FAULT_CORRUPT_SYNC=r``: rank r perturbs the projector state it receives (the checksum
  exchange must report the boundary);
* ``MAPL_FAULT_DATA_DELAY_S=x``: rank 0 takes x seconds longer to open (verify) the data (the others
  must wait for it, however long, and not report a dead peer).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["FaultPlan", "exit_with_parent"]


def _float_env(env, name: str, default: float) -> float:
    try:
        return float(env.get(name, default))
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is invalid: must be a number") from None


def _int_env(env, name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer") from None


@dataclass(frozen=True)
class FaultPlan:
    kill_rank: int | None = None
    kill_step: int = 0
    hang: bool = False
    hang_s: float = 300.0
    sigterm_rank: int | None = None
    sigterm_step: int | None = None
    corrupt_sync_rank: int | None = None
    data_delay_s: float = 0.0

    @classmethod
    def from_env(cls, env=None) -> "FaultPlan":
        env = os.environ if env is None else env
        mode = env.get("MAPL_FAULT_MODE", "exit")
        if mode not in ("exit", "hang"):
            raise ValueError(f"MAPL_FAULT_MODE={mode!r} is invalid: allowed 'exit', 'hang'")
        hang_s, delay_s = _float_env(env, "MAPL_FAULT_HANG_S", 300.0), _float_env(env, "MAPL_FAULT_DATA_DELAY_S", 0.0)
        return cls(kill_rank=_int_env(env, "MAPL_FAULT_KILL_RANK"), kill_step=_int_env(env, "MAPL_FAULT_KILL_STEP") or 0,
                   hang=mode == "hang", hang_s=hang_s, data_delay_s=delay_s,
                   sigterm_rank=_int_env(env, "MAPL_FAULT_SIGTERM_RANK"),
                   sigterm_step=_int_env(env, "MAPL_FAULT_SIGTERM_STEP"),
                   corrupt_sync_rank=_int_env(env, "MAPL_FAULT_CORRUPT_SYNC"))

    def at_step_start(self, rank: int, step: int) -> None:
        if self.sigterm_rank == rank and self.sigterm_step == step:
            os.kill(os.getpid(), signal.SIGTERM)          # a real signal, handled by the loop's stop flag

    def after_forward(self, rank: int, step: int) -> None:
        if self.kill_rank != rank or self.kill_step != step:
            return
        print(f"MAPL_FAULT: rank {rank} {'hangs' if self.hang else 'exits with os._exit(1)'} in step {step} "
              f"(fault injection: MAPL_FAULT_KILL_RANK={rank} MAPL_FAULT_KILL_STEP={step})", file=sys.stderr,
              flush=True)
        if self.hang:
            time.sleep(self.hang_s)
        os._exit(1)

    def on_sync_received(self, rank: int, tensors: list) -> list:
        return [t + 1e-3 for t in tensors] if self.corrupt_sync_rank == rank else tensors


_PR_SET_PDEATHSIG = 1


def exit_with_parent(sig: int = signal.SIGTERM, mechanism: str = "prctl", poll_s: float = 1.0) -> str:
    """Make this process receive ``sig`` when its parent (the launcher) dies, so a killed launcher never
    leaves stage processes training as orphans. SIGTERM is the graceful stop: the step in flight
    completes, checkpoints are written, exit 130. ``mechanism``: ``"prctl"`` (Linux
    ``prctl(PR_SET_PDEATHSIG)``; a watchdog thread polling the parent pid every ``poll_s`` where prctl is missing)
    or ``"watchdog"`` (the thread always: the kernel's signal fires when the parent *thread* that spawned the
    process ends, which is wrong for a process spawned by a pool's helper thread). Returns which mechanism is
    active."""
    if mechanism not in ("prctl", "watchdog"):
        raise ValueError(f"mechanism={mechanism!r} is invalid: allowed 'prctl', 'watchdog'")
    parent = os.getppid()
    active = "watchdog"
    if mechanism == "prctl":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl failed")
            active = "prctl"
        except (OSError, AttributeError):
            pass
    if active == "watchdog":
        def watch():
            while os.getppid() == parent:
                time.sleep(poll_s)
            os.kill(os.getpid(), sig)
        threading.Thread(target=watch, name="mapl-parent-watchdog", daemon=True).start()
    if os.getppid() != parent:           # the parent died before the mechanism took effect
        os.kill(os.getpid(), sig)
    return active
