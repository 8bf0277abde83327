"""Fault injection for the multi-process tests, from the environment (a malformed variable is refused at start):
``MAPL_FAULT_KILL_RANK``/``_STEP`` (exit, or with ``MAPL_FAULT_MODE=hang`` hang ``MAPL_FAULT_HANG_S``, in the
middle of a step), ``MAPL_FAULT_SIGTERM_RANK``/``_STEP``, ``MAPL_FAULT_CORRUPT_SYNC`` (perturb the received
state), ``MAPL_FAULT_DATA_DELAY_S`` (rank 0 opens the data later). And what makes a rank leave with its launcher."""
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
    def from_env(cls) -> "FaultPlan":
        env = os.environ
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
    """Receive ``sig`` (the graceful stop) when the parent dies, so no rank trains as an orphan: by
    ``prctl(PR_SET_PDEATHSIG)``, or a thread polling the parent pid (``"watchdog"``; also where prctl is missing:
    the kernel's signal fires when the spawning *thread* ends, wrong under a pool's helper thread). Which is active."""
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
