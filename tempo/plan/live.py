"""The live bytes of a real step, storage by storage: the counter the plan's predictions are held to
on the CPU (tempo.plan.band's table, tempo.plan.confirm's CPU measure)."""

from __future__ import annotations

import gc
import weakref
from typing import Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tempo.ops.linear_cross_entropy import SCRATCH


def _rounded(nbytes: int, round_to: int) -> int:
    return -(-nbytes // round_to) * round_to


class LiveStorages(TorchDispatchMode):
    """The live bytes of a step and their peak. ``baseline``: the tensors whose storages are alive
    before the step and count toward it (model weights and buffers, optimizer states, the batch),
    each storage once (a weight and its transposed view are one). Every other storage alive at entry
    (found through the garbage collector) is known but not counted: it is no part of the step. Then
    each storage an op makes is added until it is freed (a weak reference's callback). No module
    hooks: nothing is held longer than the step holds it. The sizes are kept in order, so one step
    gives the peak at any rounding (``peak``)."""

    def __init__(self, baseline: Sequence[torch.Tensor]):
        super().__init__()
        self._seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        for obj in gc.get_objects():  # type(), not isinstance: some objects warn when asked their __class__
            if issubclass(type(obj), torch.Tensor) and not obj.is_nested and obj.device.type != "meta":
                self._seen[obj.untyped_storage()] = True
        self._baseline = [s.nbytes() for s in {id(t.untyped_storage()): t.untyped_storage() for t in baseline}.values()]
        # +bytes when a storage is made, -bytes when it is freed, None after each op: the moments the
        # peak is read at (an op's inputs are still alive then: they die after it).
        self._changes: list = []
        self._refs: list = []

    def peak(self, round_to: int = 1) -> int:
        """The peak live bytes, each storage rounded up to a multiple of ``round_to`` (512: as the
        CUDA caching allocator rounds)."""
        live = sum(_rounded(n, round_to) for n in self._baseline)
        peak = live
        for change in self._changes:
            if change is None:
                peak = max(peak, live)
            else:
                live += _rounded(change, round_to) if change > 0 else -_rounded(-change, round_to)
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in SCRATCH:  # an op whose inside the plan counts: measure its inside
            from torch._library.custom_ops import OPDEFS

            with self:
                out = OPDEFS[func.name()]._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage in self._seen:  # a view, an in-place result, or a storage from before the step
                continue
            self._seen[storage] = True
            nbytes = storage.nbytes()
            self._refs.append(weakref.ref(storage, lambda _ref, n=nbytes: self._changes.append(-n)))
            self._changes.append(nbytes)
        self._changes.append(None)
        return out


__all__ = ["LiveStorages"]
