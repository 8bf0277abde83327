"""Counting device-to-host reads: what makes the host wait for the device (and every kernel queued before).

    with counting_host_reads() as reads:
        step()
    reads.total, reads.counts            # e.g. 1, {"tolist": 1}

Two ways a read happens, both counted here, each read once:

* an ATen op the host must wait for: a scalar (``_local_scalar_dense``: ``item``, ``int()``, ``bool()``),
  a data-dependent output shape (``nonzero``, boolean-mask indexing, ``unique``...), CUDA's ``bincount``
  (it reads min and max), ``equal``, a copy from another device to the CPU. A ``TorchDispatchMode``
  sees these by name;
* a read that dispatches no op when the tensor is already on the CPU: ``tolist``, ``numpy`` and
  ``__array__`` (on CUDA they copy to the host first, which the mode would see). So that a CPU
  rehearsal counts what a GPU would pay, these methods (and ``item`` and ``__bool__``) are patched on
  ``torch.Tensor`` while counting; the ops they dispatch inside are not counted a second time.

The patch is global to the process while the context is open (one thread counts at a time).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_READ_OPS", "PATCHED_READS", "HostReads", "counting_host_reads"]

# ops whose result the host must wait for: a value, a data-dependent shape, or a device read inside
HOST_READ_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                           "unique_consecutive", "unique_dim", "repeat_interleave", "equal", "bincount"})
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# Tensor methods that read values on the host (the first three dispatch nothing for a CPU tensor)
PATCHED_READS = ("tolist", "numpy", "__array__", "item", "__bool__")


class HostReads(TorchDispatchMode):
    """Counts, by name, the host reads of the ops run under it (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.inside_read = 0          # > 0 while a patched method runs: its own ops are that one read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not self.inside_read and (name in HOST_READ_OPS or _copies_to_cpu(name, args, kwargs)
                                     or _mask_index(name, args)):
            self.add(f"{name}[bool mask]" if name in _INDEX_OPS else name)
        return func(*args, **kwargs)

    def add(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _mask_index(name: str, args) -> bool:
    """Indexing by a boolean mask (``x[x > 0]``): the result's size is the mask's count, read by the host."""
    if name not in _INDEX_OPS or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


def _copies_to_cpu(name: str, args, kwargs) -> bool:
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if name == "_to_copy" and src is not None:
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and src.device.type != "cpu"
    if name == "copy_" and src is not None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return src.device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _counted(counter: HostReads, name: str, real):
    @functools.wraps(real)
    def read(self, *args, **kwargs):
        if counter.inside_read:
            return real(self, *args, **kwargs)
        counter.add(name)
        counter.inside_read += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            counter.inside_read -= 1
    return read


@contextlib.contextmanager
def counting_host_reads():
    """``with counting_host_reads() as reads:`` counts the host reads of the code inside into ``reads``."""
    counter = HostReads()
    own = {name: torch.Tensor.__dict__.get(name) for name in PATCHED_READS}
    for name in PATCHED_READS:
        setattr(torch.Tensor, name, _counted(counter, name, getattr(torch.Tensor, name)))
    try:
        with counter:
            yield counter
    finally:
        for name, original in own.items():
            if original is None:
                delattr(torch.Tensor, name)          # inherited from the C base class: drop the override
            else:
                setattr(torch.Tensor, name, original)
