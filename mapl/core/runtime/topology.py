"""Where each process sits: global rank g runs stage ``g % P`` of replica ``g // P`` (a replica's stages are
consecutive ranks; the R copies of a stage form its data-parallel group), and the process groups."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Topology", "init_distributed", "detect_launcher", "check_local_gpus", "SETUP_TIMEOUT_S"]

# the default group's timeout: "none" (ranks may wait hours for data); training uses the run's timeout
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
    """Refuse more stage processes on this CUDA machine than it has GPUs (ranks would share one, and NCCL fail).
    ``processes``: default the launcher's ``LOCAL_WORLD_SIZE`` (unset: no check)."""
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
    """Process-group setup through accelerate (which never wraps the model): (rank, world, device, backend)."""
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
        return self.replica * self.stages + stage

    def make_groups(self, timeout_s: float) -> tuple[object, object | None]:
        """(a world group with the run's timeout, this stage's data-parallel group or None); collective."""
        tmo = timedelta(seconds=timeout_s)
        world = dist.new_group(timeout=tmo)
        mine = None
        if self.replicas > 1:
            for s in range(self.stages):
                g = dist.new_group([r * self.stages + s for r in range(self.replicas)], timeout=tmo)
                if s == self.stage:
                    mine = g
        return world, mine
