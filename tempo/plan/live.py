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
    each storage an op makes is added until it is freed (a weak reference's callback), and each
    change of a storage's size (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2
    allocates and frees its unsharded parameters and all-gather outputs that way) is added when it is
    made. No module hooks: nothing is held longer than the step holds it. The sizes are kept in
    order, so one step gives the peak at any rounding (``peak``)."""

    def __init__(self, baseline: Sequence[torch.Tensor]):
        super().__init__()
        self._seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        for obj in gc.get_objects():  # type(), not isinstance: some objects warn when asked their __class__
            if issubclass(type(obj), torch.Tensor) and not obj.is_nested and obj.device.type != "meta":
                self._seen[obj.untyped_storage()] = True
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in baseline}.values()
        self._baseline = [s.nbytes() for s in storages]
        # +bytes when a storage is made, -bytes when it is freed, None after each op: the moments the
        # peak is read at (an op's inputs are still alive then: they die after it).
        self._changes: list = []
        self._refs: list = []
        # Per storage this counter counts bytes of (made in the step, or resized in it): a one-element
        # list of its counted bytes, so that its freeing subtracts what it holds then.
        self._counted: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        for storage in storages:  # counted, and resizable, but not subtracted when freed (as before)
            self._counted[storage] = [storage.nbytes()]
        self._resize = None
        self._depth = 0

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

    def _track(self, storage: torch.UntypedStorage, nbytes: int) -> list:
        cell = [nbytes]
        self._counted[storage] = cell
        self._refs.append(weakref.ref(storage, lambda _ref, c=cell: self._changes.append(-c[0])))
        return cell

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        before = storage.nbytes()
        self._resize(storage, size)
        delta = storage.nbytes() - before
        if not delta:
            return
        cell = self._counted.get(storage)
        if cell is None:  # a storage from before the step that is not counted: from now on, what it grows
            cell = self._track(storage, 0)
        delta = max(delta, -cell[0])  # it gives back no more than was counted of it
        cell[0] += delta
        self._changes.append(delta)
        self._changes.append(None)

    def __enter__(self):
        self._depth += 1  # entered again inside itself (a custom op measured inside): patched once
        if self._depth == 1:
            self._resize = torch.UntypedStorage.resize_
            counter = self

            def resize_(storage, size):
                counter._resized(storage, size)
                return storage

            torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

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
            self._track(storage, nbytes)
            self._changes.append(nbytes)
        self._changes.append(None)
        return out


__all__ = ["LiveStorages"]
