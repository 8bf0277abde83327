"""Peak bytes of the tensors a function creates, on any device: what the memory plan's terms are checked by."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created inside it and still referenced; keeps the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}      # storage pointer -> [bytes, tensors referring to it]
        self.outside: set[int] = set()            # storages that existed before (parameters, inputs)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                self.outside.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.outside and key not in self.live:      # a view of a tensor made before
            return
        if key not in self.live:
            self.live[key] = [st.nbytes(), 0]
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[key]


def live_tensor_peak(fn) -> tuple[int, object]:
    """(peak bytes of the tensors ``fn()`` creates, its result) on any device: what the plan's terms are checked by."""
    mode = _LiveBytes()
    with mode:
        out = fn()
    return mode.peak, out
