"""The step's one all-reduce, a float64 vector summed over every rank:

    [ per-parameter grad norms (N) | has-grad flags (N) | non-finite flags (2P) | stop request | loss ]

The norms give the global norm for clipping, bit-identical to ``clip_grad_norm_`` in one process (same norms,
same order, grouped by dtype as torch does; after the replicas' sum they arrive R times). Stage s flags 2s for a
non-finite received message and 2s + 1 for its own output; a signal on any rank rides on the stop slot.
"""
from __future__ import annotations

import torch

__all__ = ["StepAgreement", "nonfinite_place"]


def nonfinite_place(flags: list[float]) -> str:
    """The first place holding a non-finite value, from the 2P flags."""
    P = len(flags) // 2
    for s in range(P):
        if flags[2 * s] > 0:
            return f"boundary {s - 1} message after the wire (received by stage {s})"
        if flags[2 * s + 1] > 0:
            return f"stage {s} output (boundary {s}, before the wire)" if s < P - 1 else f"stage {s} loss"
    return "the loss only (activations finite)"


class StepAgreement:
    def __init__(self, global_params: list[tuple[str, torch.dtype]], owned: list[tuple[int, torch.nn.Parameter]],
                 stages: int, stage: int, replicas: int, clipping: bool, device: torch.device):
        self.global_params, self.owned = global_params, owned
        self.P, self.stage, self.R, self.device = stages, stage, replicas, device
        self.N = len(global_params) if clipping else 0

    def vector(self, loss_sum: torch.Tensor, bad_in: torch.Tensor, bad_out: torch.Tensor, stop: bool) -> torch.Tensor:
        N, P = self.N, self.P
        vec = torch.zeros(2 * N + 2 * P + 2, dtype=torch.float64, device=self.device)
        if N:
            have = [(i, p) for i, p in self.owned if p.grad is not None]
            if have:
                norms = torch._foreach_norm([p.grad for _, p in have], 2.0)
                idx = torch.tensor([i for i, _ in have], device=self.device)
                vec[idx] = torch.stack([n.to(torch.float64) for n in norms])
                vec[N + idx] = 1.0
        vec[2 * N + 2 * self.stage] = bad_in.to(torch.float64)
        vec[2 * N + 2 * self.stage + 1] = bad_out.to(torch.float64)
        vec[-2] = 1.0 if stop else 0.0
        vec[-1] = loss_sum
        return vec

    def read(self, vec: torch.Tensor) -> tuple[float, bool, list[float], list[bool]]:
        """(global loss, stop, non-finite flags, has-grad mask) from the summed vector, in one host read."""
        N, P = self.N, self.P
        if self.R > 1 and N:
            vec[:2 * N] /= self.R
        host = vec[N:].tolist()
        return host[-1], host[-2] > 0, host[N:N + 2 * P], [f > 0 for f in host[:N]]

    def clip(self, vec: torch.Tensor, mask: list[bool], max_norm: float) -> None:
        """Clip this rank's parameters with the whole model's norm."""
        groups: dict = {}
        for i, (_, dt) in enumerate(self.global_params):
            if mask[i]:
                groups.setdefault(dt, []).append(vec[i].to(dt))
        norms = [n for g in groups.values() for n in g]
        if not norms:
            return
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch.nn.utils.clip_grads_with_norm_([p for _, p in self.owned], max_norm, total)
