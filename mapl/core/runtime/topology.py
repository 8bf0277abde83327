"""Where each process sits: P pipeline stages x R data-parallel replicas, and the process groups.

Global rank g runs stage ``g % P`` of replica ``g // P``: a replica's stages are consecutive ranks
(neighbours in the pipeline are ranks g - 1 and g + 1), and the R copies of stage s (ranks s, s + P,
s + 2P, ...) form that stage's data-parallel group, where gradients are summed every step. With
R = 1 rank = stage, as in the plain pipeline.

The default process group is created with a long timeout: before training, ranks may wait for rank 0
to prepare the data for as long as that takes. Everything during training uses groups made with the
run's timeout (``--timeout``), so a dead peer is reported within that time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Topology", "init_distributed", "detect_launcher", "check_local_gpus", "SETUP_TIMEOUT_S"]

# waiting for rank 0 to prepare data (tokenising a paper-scale corpus takes hours): "no timeout"
SETUP_TIMEOUT_S = 7 * 24 * 3600.0


def detect_launcher() -> str:
    if "ACCELERATE_MIXED_PRECISION" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ:
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "env"


def _wants_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")


def check_local_gpus(processes: int | None = None) -> None:
    """Refuse (one-line ValueError) more stage processes on this machine than it has GPUs, on a CUDA
    run: accelerate gives local rank i GPU ``i % device_count``, so ranks would share a GPU (memory
    planned for one stage holding two) and NCCL fails inside its first operation. ``processes``: the
    count this command is about to start; default the launcher's ``LOCAL_WORLD_SIZE`` (no check when
    it is not set: the count per machine is then unknown)."""
    if not _wants_cuda():
        return
    if processes is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not local.isdigit():
            return
        processes = int(local)
    gpus = torch.cuda.device_count()
    if processes > gpus:
        raise ValueError(f"{processes} stage processes on this machine but {gpus} GPU(s): every process needs a GPU "
                         f"of its own (P x replicas per machine must be <= {gpus}); use fewer stages or replicas, or "
                         f"more machines")


def init_distributed() -> tuple[int, int, torch.device, str]:
    """Process-group setup through accelerate (a launcher/initialiser only; it never wraps the model):
    gloo on CPU, NCCL on GPU. Returns (rank, world, device, backend)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = _wants_cuda()
    acc = Accelerator(cpu=not cuda, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=SETUP_TIMEOUT_S))])
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, torch.device("cpu"), ""
    device = acc.device if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device, dist.get_backend()


@dataclass
class Topology:
    rank: int
    world: int
    stages: int
    device: torch.device
    backend: str = "gloo"
    launcher: str = "env"

    def __post_init__(self):
        if self.world % self.stages:
            raise ValueError(f"{self.world} process(es) cannot be split into pipelines of stages={self.stages}: the "
                             f"process count must be a multiple of the stage count (P x replicas)")

    @property
    def replicas(self) -> int:
        return self.world // self.stages

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def prev(self) -> int | None:
        return None if self.first else self.rank - 1

    @property
    def next(self) -> int | None:
        return None if self.last else self.rank + 1

    def peer(self, stage: int) -> int:
        """The global rank of ``stage`` in this replica."""
        return self.replica * self.stages + stage

    def make_groups(self, timeout_s: float) -> tuple[object, object | None]:
        """(a world group with the run's timeout, this stage's data-parallel group or None when R = 1).
        Collective: every rank creates every group, in the same order."""
        tmo = timedelta(seconds=timeout_s)
        world = dist.new_group(timeout=tmo)
        mine = None
        if self.replicas > 1:
            for s in range(self.stages):
                g = dist.new_group([r * self.stages + s for r in range(self.replicas)], timeout=tmo)
                if s == self.stage:
                    mine = g
        return world, mine
