"""Counting what a Triton kernel loads and stores, in Triton's interpreter (TRITON_INTERPRET=1).

``count_triton_memory()`` wraps the interpreter's memory operations (``create_masked_load`` /
``create_masked_store``, which every ``tl.load``/``tl.store`` reaches) and its launcher, and
records for each launch the bytes of global memory the kernel touched: for each access, the
addresses of the lanes its mask enables; per launch, each distinct address once (the kernel's
footprint: what DRAM has to deliver once, re-reads of the same bytes within a launch hit the
caches, as for γ and β, which every row's program loads). Addresses are attributed to the
kernel's tensor arguments by storage, for messages. Atomics, block pointers and tensor
descriptors are refused while counting: no Tempo kernel uses them, and their traffic is not
modelled here.

Used by tests/test_movement.py to check each ``triton=True`` kernel of a declaration
(tempo/movement/declarations.py) against the kernel itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np


@dataclass
class Launch:
    """One kernel launch: bytes loaded and stored (distinct addresses), in total and per argument."""

    kernel: str
    grid: tuple
    read: int = 0
    written: int = 0
    read_by_arg: dict[str, int] = field(default_factory=dict)
    written_by_arg: dict[str, int] = field(default_factory=dict)


@dataclass
class _Accesses:
    loads: list[tuple[np.ndarray, int]] = field(default_factory=list)
    stores: list[tuple[np.ndarray, int]] = field(default_factory=list)


def _footprint(accesses: list[tuple[np.ndarray, int]], ranges: list[tuple[str, int, int]]) -> tuple[int, dict]:
    if not accesses:
        return 0, {}
    # (address, size) pairs; a byte address is one element of one size in these kernels.
    addresses = np.concatenate([a for a, _ in accesses])
    sizes = np.concatenate([np.full(a.shape, s, dtype=np.uint64) for a, s in accesses])
    unique, index = np.unique(addresses, return_index=True)
    unique_sizes = sizes[index]
    total = int(unique_sizes.sum())
    by_arg: dict[str, int] = {}
    claimed = np.zeros(unique.shape, dtype=bool)
    for name, start, end in ranges:
        inside = (unique >= start) & (unique < end) & ~claimed
        if inside.any():
            by_arg[name] = by_arg.get(name, 0) + int(unique_sizes[inside].sum())
            claimed |= inside
    if (~claimed).any():
        by_arg["?"] = int(unique_sizes[~claimed].sum())
    return total, by_arg


class TritonMemoryCounter:
    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._current: Optional[tuple[Launch, _Accesses, list]] = None

    @property
    def read(self) -> int:
        return sum(launch.read for launch in self.launches)

    @property
    def written(self) -> int:
        return sum(launch.written for launch in self.launches)

    def _record(self, kind: str, ptrs, mask) -> None:
        if self._current is None:
            raise RuntimeError("tempo.movement: a Triton memory access outside a counted launch")
        _, accesses, _ = self._current
        data = np.asarray(ptrs.data)
        enabled = np.broadcast_to(np.asarray(mask.data, dtype=bool), data.shape)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        (accesses.loads if kind == "load" else accesses.stores).append(
            (data[enabled].astype(np.uint64).ravel(), size))


@contextlib.contextmanager
def count_triton_memory() -> Iterator[TritonMemoryCounter]:
    """Count the global-memory footprint of every Triton launch inside the block (the interpreter
    must be on: TRITON_INTERPRET=1 before triton is imported)."""
    from triton.runtime import interpreter as interp

    if not hasattr(interp, "interpreter_builder"):
        raise RuntimeError("tempo.movement: Triton's interpreter is not available in this triton build")
    builder = interp.interpreter_builder
    executor = interp.GridExecutor
    counter = TritonMemoryCounter()
    original_load, original_store = builder.create_masked_load, builder.create_masked_store
    original_call, original_init = executor.__call__, executor._init_args_hst

    # (ptrs, mask, other, <cache and volatility flags>) and (ptrs, value, mask, <flags>): the flags
    # differ between triton versions (3.6: cache_modifier, eviction_policy; 3.9: cache_policy).
    def load(ptrs, mask, *rest, **kwargs):
        counter._record("load", ptrs, mask)
        return original_load(ptrs, mask, *rest, **kwargs)

    def store(ptrs, value, mask, *rest, **kwargs):
        counter._record("store", ptrs, mask)
        return original_store(ptrs, value, mask, *rest, **kwargs)

    def refuse(name):
        def refused(*args, **kwargs):
            raise NotImplementedError(f"tempo.movement: {name} is not counted by count_triton_memory")
        return refused

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_init(self, args_dev, kwargs)
        if counter._current is not None:
            ranges = counter._current[2]
            for name, value in list(zip(self.arg_names, args_hst)) + list(kwargs_hst.items()):
                if hasattr(value, "untyped_storage"):
                    storage = value.untyped_storage()
                    ranges.append((name, storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        if counter._current is not None:
            raise RuntimeError("tempo.movement: nested Triton launches are not counted")
        launch = Launch(kernel=self.fn.__name__, grid=self.grid if isinstance(self.grid, tuple) else ())
        counter._current = (launch, _Accesses(), [])
        try:
            result = original_call(self, *args, **kwargs)
            _, accesses, ranges = counter._current
            launch.read, launch.read_by_arg = _footprint(accesses.loads, ranges)
            launch.written, launch.written_by_arg = _footprint(accesses.stores, ranges)
            counter.launches.append(launch)
            return result
        finally:
            counter._current = None

    refused = {name: getattr(builder, name) for name in dir(builder)
               if name.startswith(("create_atomic", "create_descriptor", "create_tensor_pointer"))}
    builder.create_masked_load, builder.create_masked_store = load, store
    for name in refused:
        setattr(builder, name, refuse(name))
    executor.__call__, executor._init_args_hst = call, init_args
    try:
        yield counter
    finally:
        del builder.create_masked_load, builder.create_masked_store
        for name in refused:
            delattr(builder, name)
        executor.__call__, executor._init_args_hst = original_call, original_init


__all__ = ["Launch", "TritonMemoryCounter", "count_triton_memory"]
